"""`cpn catalog generate`: a deterministic world of Sites, Clusters and Links as multi-document YAML."""

from __future__ import annotations

from typing import TextIO

import click
import yaml

__all__ = ["catalog_generate_cmd"]

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


@click.command("generate")
@click.option("--sites", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--clusters", type=click.IntRange(min=0), default=12, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same world.")
@click.option("--providers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Spread sites over provider1..N (label cpn.io/provider). Applied by an admin every link is "
                   "active; applied by each provider, a link between two providers' sites is used only once "
                   "both applied it (docs/security.md, M4).")
@click.option("--links", type=click.IntRange(min=0), default=None,
              help="At most this many links (connected when at least sites-1).")
@click.option("-o", "--output", type=click.File("w"), default="-", help="File to write [stdout].")
def catalog_generate_cmd(sites: int, clusters: int, seed: int, providers: int, links: int | None,
                         output: TextIO) -> None:
    """Print Sites, Clusters and Links for `cpnctl apply -f`.

    \b
      cpn catalog generate --sites 12 --clusters 40 --seed 7 --providers 3 > catalog.yaml
    """
    from layers.resource.catalog import generate_world

    world = generate_world(sites, clusters, seed=seed, providers=providers, links=links)
    yaml.dump_all(world, output, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    counts = {kind: sum(1 for d in world if d["kind"] == kind) for kind in ("Site", "Cluster", "Link")}
    click.echo(", ".join(f"{n} {kind.lower()}s" for kind, n in counts.items()), err=True)
