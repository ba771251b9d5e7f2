"""Typed application state (aiohttp AppKeys)."""

from __future__ import annotations

from aiohttp import web

from cpn.api.openapi import RouteDoc
from cpn.core.db import Database
from cpn.core.kinds import KindRegistry
from cpn.core.settings import Settings
from layers.resource.blobs import BlobStore

DB = web.AppKey("db", Database)
SETTINGS = web.AppKey("settings", Settings)
KINDS = web.AppKey("kinds", KindRegistry)
DOCS = web.AppKey("docs", list[RouteDoc])
BLOBS = web.AppKey("blobs", BlobStore)  # checkpoints, code bundles, final weights
