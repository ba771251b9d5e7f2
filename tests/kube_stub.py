"""A small Kubernetes API server for tests: the real JSON on the real paths, objects in memory.

No API server can be installed on these machines, so the official client is tested against
this one. It runs `http.server` in a thread (the kubernetes client is synchronous, so an
event-loop server would deadlock a test that calls the client directly).

Generic REST over an in-memory store keyed by (group/version, namespace, plural):

    GET    /api/v1/{plural}                              list (all namespaces for namespaced kinds)
    GET    /api/v1/namespaces/{ns}/{plural}              list in a namespace
    GET    /api/v1/[namespaces/{ns}/]{plural}/{name}     get
    POST   /api/v1/[namespaces/{ns}/]{plural}            create (uid, resourceVersion, timestamps)
    PUT    .../{name}[/status]                           replace
    PATCH  .../{name}[/status]                           JSON merge patch
    DELETE .../{name}                                    delete, answers a Status; dependents (by
                                                         ownerReferences) go too, as the garbage
                                                         collector does, unless propagationPolicy=Orphan
                                                         (the default for Jobs, as in Kubernetes)
    and the same under /apis/{group}/{version}/...       (e.g. batch/v1 jobs)
    GET    /version

`labelSelector` (=, !=, existence) and `fieldSelector` (=, != on dotted paths) filter lists;
`limit` and `continue` page them.
Extend it with `stub.route(method, regex, handler)` for special endpoints (pod logs, …) and
`stub.on(verb, plural, hook)` to react to changes (a Job controller creating pods, …).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import threading
import uuid
import zlib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

Obj = dict[str, Any]
Key = tuple[str, str, str]  # (group/version, namespace or "", plural)
Reply = tuple[int, Obj | str]
Handler = Callable[["KubeStub", "Request"], Reply]
Hook = Callable[["KubeStub", Obj], None]

SERVER_VERSION: Obj = {
    "major": "1", "minor": "30", "gitVersion": "v1.30.4", "gitCommit": "a51b3b711150f57ffc1f526a640ec058514ed596",
    "gitTreeState": "clean", "buildDate": "2024-08-14T18:57:35Z", "goVersion": "go1.22.5",
    "compiler": "gc", "platform": "linux/amd64",
}
CLUSTER_SCOPED = {"nodes", "namespaces", "persistentvolumes", "clusterroles", "clusterrolebindings",
                  "storageclasses", "priorityclasses", "customresourcedefinitions"}
KINDS = {
    "nodes": "Node", "pods": "Pod", "services": "Service", "namespaces": "Namespace", "configmaps": "ConfigMap",
    "secrets": "Secret", "events": "Event", "endpoints": "Endpoints", "jobs": "Job", "deployments": "Deployment",
    "persistentvolumeclaims": "PersistentVolumeClaim", "serviceaccounts": "ServiceAccount",
}
PLURALS = {kind: plural for plural, kind in KINDS.items()}
ORPHAN_BY_DEFAULT = {"jobs"}  # batch/v1 Jobs keep their pods unless a propagationPolicy says otherwise
GPU = "nvidia.com/gpu"


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_body(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    """The `Status` object the API server answers errors (and deletes) with."""
    body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                 "status": "Success" if code < 400 else "Failure", "message": message, "reason": reason,
                 "code": code}
    if details is not None:
        body["details"] = details
    return body


def plural_of(kind: str) -> str:
    if kind in PLURALS:
        return PLURALS[kind]
    lower = kind.lower()
    return lower[:-1] + "ies" if lower.endswith("y") else lower + ("es" if lower.endswith("s") else "s")


def dig(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)
    return obj


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what `application/merge-patch+json` means)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _terms(text: str) -> Iterator[tuple[str, str, str | None]]:
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            yield key.strip(), "!=", value.strip()
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            yield key.strip(), "=", value.strip()
        elif term.startswith("!"):
            yield term[1:].strip(), "!exists", None
        else:
            yield term, "exists", None


def matches(obj: Obj, label_selector: str = "", field_selector: str = "") -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for key, op, value in _terms(label_selector):
        if (op == "exists" and key not in labels) or (op == "!exists" and key in labels):
            return False
        if (op == "=" and labels.get(key) != value) or (op == "!=" and labels.get(key) == value):
            return False
    for key, op, value in _terms(field_selector):
        actual = dig(obj, key)
        actual = "" if actual is None else str(actual)
        if (op == "=" and actual != value) or (op == "!=" and actual == value):
            return False
    return True


class Request:
    def __init__(self, method: str, path: str, query: dict[str, str], headers: dict[str, str], body: Any):
        self.method, self.path, self.query, self.headers, self.body = method, path, query, headers, body
        self.match: re.Match[str] | None = None


class KubeStub:
    """In-memory Kubernetes API. `token`, when set, is required as `Authorization: Bearer`."""

    def __init__(self, *, token: str | None = "stub-token", version: Obj | None = None):
        self.token = token
        self.version = dict(version or SERVER_VERSION)
        self.store: dict[Key, dict[str, Obj]] = {}
        self.requests: list[Request] = []
        self.lock = threading.RLock()
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []
        self._hooks: dict[tuple[str, str], list[Hook]] = {}
        self._rv = itertools.count(1000)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> KubeStub:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="kube-stub",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> KubeStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the stub first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def write_kubeconfig(self, path: Path, *, context: str = "stub", namespace: str = "default",
                         token: str | None = None) -> Path:
        """A kubeconfig with one cluster/user/context pointing at this stub over http with a token."""
        user: Obj = {"token": token or self.token or "anonymous"}
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {}, "current-context": context,
            "clusters": [{"name": context, "cluster": {"server": self.url}}],
            "users": [{"name": f"{context}-admin", "user": user}],
            "contexts": [{"name": context,
                          "context": {"cluster": context, "user": f"{context}-admin", "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    # -- objects -----------------------------------------------------------------------------------

    def add(self, *objs: Obj) -> None:
        """Put objects straight into the store (fixtures), filling server-set metadata."""
        for obj in objs:
            gv, plural = obj["apiVersion"], plural_of(obj["kind"])
            ns = "" if plural in CLUSTER_SCOPED else obj["metadata"].get("namespace", "default")
            with self.lock:
                self._insert((gv, ns, plural), copy.deepcopy(obj))

    def objects(self, plural: str, namespace: str | None = None, gv: str = "v1") -> list[Obj]:
        """Stored objects of one plural; every namespace when `namespace` is None."""
        with self.lock:
            return [copy.deepcopy(obj) for (g, ns, p), bucket in sorted(self.store.items())
                    if g == gv and p == plural and namespace in (None, ns) for obj in bucket.values()]

    def get(self, plural: str, name: str, namespace: str = "", gv: str = "v1") -> Obj | None:
        with self.lock:
            obj = self.store.get((gv, namespace, plural), {}).get(name)
            return copy.deepcopy(obj) if obj else None

    @property
    def nodes(self) -> list[Obj]:
        return self.objects("nodes")

    @property
    def pods(self) -> list[Obj]:
        return self.objects("pods")

    # -- extension points --------------------------------------------------------------------------

    def route(self, method: str, pattern: str, handler: Handler) -> None:
        """Serve `method` on paths fully matching `pattern` before the generic REST routes."""
        self._routes.append((method.upper(), re.compile(pattern), handler))

    def on(self, verb: str, plural: str, hook: Hook) -> None:
        """Call `hook(stub, obj)` after a `create`, `update` or `delete` of `plural` (under the lock)."""
        self._hooks.setdefault((verb, plural), []).append(hook)

    # -- request handling --------------------------------------------------------------------------

    def handle(self, req: Request) -> Reply:
        with self.lock:
            self.requests.append(req)
        if self.token is not None and req.headers.get("authorization") != f"Bearer {self.token}":
            return 401, status_body(401, "Unauthorized", "Unauthorized")
        for method, pattern, handler in self._routes:
            if method == req.method and (m := pattern.fullmatch(req.path)):
                req.match = m
                return handler(self, req)
        if req.path.rstrip("/") == "/version" and req.method == "GET":
            return 200, dict(self.version)
        parsed = _parse_path(req.path)
        if parsed is None:
            return 404, status_body(404, "NotFound", "the server could not find the requested resource")
        with self.lock:
            return self._rest(req, *parsed)

    def _rest(self, req: Request, gv: str, ns: str | None, plural: str, name: str | None,
              sub: str | None) -> Reply:
        if name is None:
            if req.method == "GET":
                return 200, self._list(gv, ns, plural, req.query)
            if req.method == "POST":
                return self._create(gv, ns or "", plural, req.body)
            return 405, status_body(405, "MethodNotAllowed", f"{req.method} is not allowed on a collection")
        key = (gv, "" if plural in CLUSTER_SCOPED else (ns or ""), plural)
        current = self.store.get(key, {}).get(name)
        if current is None:
            return 404, _not_found(plural, name)
        if req.method == "GET":
            return 200, copy.deepcopy(current)
        if req.method in ("PUT", "PATCH"):
            return self._update(key, current, req, sub)
        if req.method == "DELETE":
            del self.store[key][name]
            self._fire("delete", plural, current)
            options = req.body if isinstance(req.body, dict) else {}
            policy = (req.query.get("propagationPolicy") or options.get("propagationPolicy")
                      or ("Orphan" if plural in ORPHAN_BY_DEFAULT else "Background"))
            if policy != "Orphan":
                self._collect(current["metadata"].get("uid"))
            details = {"name": name, "kind": plural, "uid": current["metadata"].get("uid")}
            if gv != "v1":
                details["group"] = gv.split("/")[0]
            return 200, status_body(200, "", "", details)
        return 405, status_body(405, "MethodNotAllowed", f"{req.method} is not allowed")

    def _list(self, gv: str, ns: str | None, plural: str, query: dict[str, str]) -> Obj:
        items = []
        for (g, n, p), bucket in sorted(self.store.items()):
            if g == gv and p == plural and (ns is None or n == ns):
                items += [_as_item(o) for o in bucket.values()
                          if matches(o, query.get("labelSelector", ""), query.get("fieldSelector", ""))]
        kind = KINDS.get(plural, plural[:-1].capitalize())
        meta: Obj = {"resourceVersion": str(next(self._rv))}
        if query.get("limit"):  # chunked lists; the continue token here is simply the next offset
            start, limit = int(query.get("continue") or 0), int(query["limit"])
            if start + limit < len(items):
                meta |= {"continue": str(start + limit), "remainingItemCount": len(items) - start - limit}
            items = items[start : start + limit]
        return {"kind": f"{kind}List", "apiVersion": gv, "metadata": meta, "items": items}

    def _create(self, gv: str, ns: str, plural: str, body: Any) -> Reply:
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            return 400, status_body(400, "BadRequest", "the body must be an object with metadata")
        obj = copy.deepcopy(body)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if not meta.get("name"):
            return 422, status_body(422, "Invalid", f"{plural} \"\" is invalid: metadata.name: Required value")
        ns = "" if plural in CLUSTER_SCOPED else (ns or meta.get("namespace") or "default")
        if meta["name"] in self.store.get((gv, ns, plural), {}):
            return 409, status_body(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists',
                                    {"name": meta["name"], "kind": plural})
        obj.setdefault("apiVersion", gv)
        obj.setdefault("kind", KINDS.get(plural, plural[:-1].capitalize()))
        if plural == "services":
            obj.setdefault("spec", {}).setdefault("clusterIP", f"10.96.{len(self.objects('services')) % 250}.10")
        stored = self._insert((gv, ns, plural), obj)
        self._fire("create", plural, stored)
        return 201, copy.deepcopy(stored)

    def _update(self, key: Key, current: Obj, req: Request, sub: str | None) -> Reply:
        if not isinstance(req.body, dict):
            return 400, status_body(400, "BadRequest", "the body must be a JSON object")
        if req.method == "PATCH":
            updated = merge_patch(current, req.body)
        elif sub == "status":
            updated = {**current, "status": req.body.get("status", {})}
        else:
            updated = copy.deepcopy(req.body)
        updated["metadata"] = {**current["metadata"], **updated.get("metadata", {}),
                               "resourceVersion": str(next(self._rv))}
        if sub == "status":
            updated = {**current, "status": updated.get("status", {}), "metadata": updated["metadata"]}
        self.store[key][current["metadata"]["name"]] = updated
        self._fire("update", key[2], updated)
        return 200, copy.deepcopy(updated)

    def _collect(self, owner_uid: str | None) -> None:
        """The garbage collector: delete the dependents of a deleted owner, and theirs."""
        for (_gv, _ns, plural), bucket in list(self.store.items()):
            for name, obj in list(bucket.items()):
                refs = obj["metadata"].get("ownerReferences") or []
                if owner_uid and any(ref.get("uid") == owner_uid for ref in refs):
                    del bucket[name]
                    self._fire("delete", plural, obj)
                    self._collect(obj["metadata"].get("uid"))

    def _insert(self, key: Key, obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        if key[1]:
            meta["namespace"] = key[1]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        meta["resourceVersion"] = str(next(self._rv))
        meta.setdefault("generation", 1)
        self.store.setdefault(key, {})[meta["name"]] = obj
        return obj

    def _fire(self, verb: str, plural: str, obj: Obj) -> None:
        for hook in self._hooks.get((verb, plural), []):
            hook(self, copy.deepcopy(obj))


def _as_item(obj: Obj) -> Obj:
    """Items of a typed list carry no apiVersion/kind, as the real server sends them."""
    return {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("apiVersion", "kind")}


def _not_found(plural: str, name: str) -> Obj:
    return status_body(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})


def _parse_path(path: str) -> tuple[str, str | None, str, str | None, str | None] | None:
    """`/apis/batch/v1/namespaces/ns/jobs/x/status` → ("batch/v1", "ns", "jobs", "x", "status")."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        gv, rest = "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        gv, rest = f"{parts[1]}/{parts[2]}", parts[3:]
    else:
        return None
    ns: str | None = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        ns, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    return gv, ns, rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)


def _handler_for(stub: KubeStub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                self._send(400, status_body(400, "BadRequest", "the body is not JSON"))
                return
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            headers = {k.lower(): v for k, v in self.headers.items()}
            self._send(*stub.handle(Request(self.command, url.path, query, headers, body)))

        def _send(self, status: int, payload: Obj | str) -> None:
            is_text = isinstance(payload, str)
            data = (payload if is_text else json.dumps(payload)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if is_text else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass

    return Handler


# -- realistic fixtures ----------------------------------------------------------------------------

GPU_PRODUCTS: dict[str, tuple[str, str, str]] = {
    # product label: (memory MiB label, family, instance type)
    "NVIDIA-H100-80GB-HBM3": ("81559", "hopper", "p5.48xlarge"),
    "NVIDIA-A100-SXM4-80GB": ("81920", "ampere", "p4de.24xlarge"),
    "NVIDIA-A100-SXM4-40GB": ("40960", "ampere", "p4d.24xlarge"),
    "NVIDIA-L40S": ("46068", "ada-lovelace", "g6e.12xlarge"),
    "NVIDIA-GeForce-RTX-4090": ("24564", "ada-lovelace", "rtx4090-8x"),
}


def make_node(name: str, *, gpu_product: str | None = None, gpus: int = 8, ready: bool = True,
              unschedulable: bool = False, zone: str = "us-east-1a", ip: str = "10.0.1.10") -> Obj:
    """A Node as `kubectl get node -o json` shows it, with the GPU operator's labels when it has GPUs."""
    labels = {
        "beta.kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": "m6i.4xlarge",
        "topology.kubernetes.io/region": zone[:-1], "topology.kubernetes.io/zone": zone,
    }
    capacity = {"cpu": "192", "ephemeral-storage": "3750000000Ki", "hugepages-1Gi": "0", "hugepages-2Mi": "0",
                "memory": "2113393904Ki", "pods": "110"}
    allocatable = {"cpu": "191450m", "ephemeral-storage": "3455999998085", "hugepages-1Gi": "0",
                   "hugepages-2Mi": "0", "memory": "2102814448Ki", "pods": "110"}
    if gpu_product:
        memory, family, instance = GPU_PRODUCTS.get(gpu_product, ("16384", "unknown", "gpu-node"))
        labels |= {"node.kubernetes.io/instance-type": instance, "nvidia.com/gpu.present": "true",
                   "nvidia.com/gpu.product": gpu_product, "nvidia.com/gpu.memory": memory,
                   "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.family": family,
                   "nvidia.com/cuda.driver.major": "550", "nvidia.com/gpu.deploy.device-plugin": "true"}
        capacity[GPU] = allocatable[GPU] = str(gpus)
    spec: Obj = {"podCIDR": "192.168.0.0/24", "providerID": f"aws:///{zone}/i-0{zlib.crc32(name.encode()):016x}"}
    if unschedulable:
        spec["unschedulable"] = True
        spec["taints"] = [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule",
                           "timeAdded": "2026-11-20T08:00:00Z"}]
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels,
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                                     "volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
        "spec": spec,
        "status": {
            "capacity": capacity, "allocatable": allocatable,
            "conditions": _node_conditions(ready),
            "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": uuid.uuid5(uuid.NAMESPACE_DNS, name).hex,
                         "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
                         "bootID": str(uuid.uuid5(uuid.NAMESPACE_OID, name)),
                         "kernelVersion": "5.15.0-1063-aws", "osImage": "Ubuntu 22.04.4 LTS",
                         "containerRuntimeVersion": "containerd://1.7.19", "kubeletVersion": "v1.30.4",
                         "kubeProxyVersion": "v1.30.4", "operatingSystem": "linux", "architecture": "amd64"},
        },
    }


def _node_conditions(ready: bool) -> list[Obj]:
    t = "2026-11-21T08:00:00Z"
    pressure = [("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available")]
    out = [{"type": c, "status": "False", "lastHeartbeatTime": t, "lastTransitionTime": t, "reason": r,
            "message": m} for c, r, m in pressure]
    if ready:
        out.append({"type": "Ready", "status": "True", "lastHeartbeatTime": t, "lastTransitionTime": t,
                    "reason": "KubeletReady", "message": "kubelet is posting ready status"})
    else:
        out.append({"type": "Ready", "status": "Unknown", "lastHeartbeatTime": t, "lastTransitionTime": t,
                    "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting node status."})
    return out


def make_pod(name: str, *, node: str | None, gpus: int = 0, phase: str = "Running", namespace: str = "default",
             use_limits_only: bool = False) -> Obj:
    """A Pod as the API returns it; `gpus` go into requests+limits (or limits only, which implies requests)."""
    resources: Obj = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    if gpus:
        resources["limits"][GPU] = str(gpus)
        if not use_limits_only:
            resources["requests"][GPU] = str(gpus)
    spec: Obj = {
        "containers": [{"name": "trainer", "image": "nvcr.io/nvidia/pytorch:24.07-py3", "command": ["torchrun"],
                        "resources": resources, "imagePullPolicy": "IfNotPresent",
                        "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"}],
        "restartPolicy": "Never", "schedulerName": "default-scheduler", "serviceAccountName": "default",
        "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
        "tolerations": [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
    }
    status: Obj = {"phase": phase, "qosClass": "Burstable"}
    if node:
        spec["nodeName"] = node
        status |= {"hostIP": "10.0.1.10", "podIP": f"192.168.0.{zlib.crc32(name.encode()) % 250 + 2}",
                   "startTime": "2026-11-21T09:00:00Z",
                   "conditions": [{"type": "PodScheduled", "status": "True",
                                   "lastTransitionTime": "2026-11-21T09:00:00Z"}]}
    else:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": "0/5 nodes are available: 5 Insufficient nvidia.com/gpu.",
                                 "lastTransitionTime": "2026-11-21T09:00:00Z"}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name.rsplit("-", 1)[0]}},
            "spec": spec, "status": status}
