"""Configuration: /etc/migrt/config.yaml, or the file named by MIGRT_CONFIG.

Keys (all optional):
  runtime: runc                      lower runtime: a path or a name on PATH (never migrt-runc)
  criu: (none)                       CRIU binary (default: migrt's own build, /opt/migrt/criu/sbin/criu)
  store: /var/lib/migrt              checkpoint store root
  restore_failure_policy: fail       fail | fresh (on a failed restore, run the original create)
  log_file: /var/log/migrt/migrt.log migrt's own debug log (JSON lines)
  log_level: info                    debug | info | warning | error
  runtime_roots: []                  extra runc state roots to search for containers
  criu_options: {}                   defaults for checkpoints: tcp_established, ext_unix_sk, file_locks
  gpu_backend: auto                  auto | cuda | none (auto: the CUDA driver API when libcuda.so.1 has it)
  gpu_lock_timeout_ms: 30000         how long a CUDA process may take to reach a lockable point
  gpu_hook_timeout_s: 30             how long a process that registered the application hook may take to
                                     answer (docs/gpu.md, Multi-GPU jobs)
  gpu_peer_check: refuse             refuse | warn: CUDA processes with peer state the driver cannot restore
  gpu_checkpoint_thp: keep           keep | always: always switches transparent huge pages (node-wide) to
                                     `always` only while the driver writes its checkpoint, then puts the
                                     value back: a faster driver checkpoint (docs/gpu.md, Faster driver
                                     checkpoints); keep never touches /sys
  allow_cross_namespace_restore: false  restore a pod's checkpoint into another Kubernetes namespace
  allow_unbound_checkpoints: false   restore a checkpoint that records no Kubernetes namespace (not taken
                                     from a pod, or made by hand) into a pod container
  store_space_check: true            refuse a checkpoint (before freezing) when the store cannot hold it
  migration_key_file: (none)         file with the secret shared by nodes that migrate to each other
  migration_tls: (none)              {cert, key, ca}: TLS for migrations (docs/migration.md)
  agent_listen: 0.0.0.0:7070         where the node agent (`migrt serve`) takes pulls from other nodes' pods
                                     and their questions; its port is the one a pulling pod's node is asked on
  migrate_any_container: false       the agent hands over any container of this node to a pull; otherwise
                                     only pods annotated migrt.io/migratable=true (docs/migration.md)
  migrate_peers: []                  node agents a pod's migrate-from may name (this node connects to them):
                                     ADDRESS[:PORT] entries, ADDRESS an IP, a CIDR block, a host name or
                                     '*.domain'; no port: 7070, '*': any; names are matched as written, never
                                     resolved to be checked; none by default: every pull is refused
  registry_auth_file: (none)         docker-style config.json with registry credentials (docs/registry.md)
  registry_ca_file: (none)           CA bundle for registries (default: the system's)
  registry_parallel: 4               blobs moved at once by push and pull
  registry_timeout: 60               seconds a restore by reference (`MIGRT_RESTORE=oci:...` in a create) may
                                     spend pulling, all requests and retries together; keep it below kubelet's
                                     runtimeRequestTimeout (2 minutes) less the restore's own time (docs/registry.md)
  restore_registries: []             registries a container's create may pull from (`oci:HOST/...` restore
                                     requests): host[:port] entries, '*' wildcards in the host (no port: 443);
                                     none by default. `migrt pull` is not limited (docs/registry.md)
  migration_stall_timeout: 10        seconds without progress (bytes, messages, CRIU I/O) after which a
                                     migration gives up on the peer or kills a stuck CRIU (docs/migration.md)
  pod_pull_deadline: 30              seconds a pod-level pull waits for the new pod's last container: the
                                     source pod stays frozen that long at most, then resumes whole and the
                                     parts restored here are removed (docs/kubernetes.md, The pod-level pull)
  migration_streams: 0               connections a stop-and-copy migration's files travel over at once, as
                                     sender (`migrate --streams` overrides) and the most a receiver takes
                                     (`receive --streams`); 0: half the CPUs, 1 to 8 (docs/migration.md)
  restore_pages: auto                auto | lazy | eager: how a restore fills memory (docs/restore-pages.md);
                                     MIGRT_RESTORE_PAGES in the environment overrides it per call
  fill_threads: 0                    copy threads of the page filler (0: min(16, CPUs))
  fill_min_mib: 256                  'auto' uses the page filler from this much lazy memory on
  dump_pages: auto                   auto | parallel | criu: who writes a checkpoint's memory (docs/dump-pages.md);
                                     MIGRT_DUMP_PAGES in the environment overrides it per call
  dump_threads: 0                    writer threads of the parallel dump (0: min(16, CPUs))
  criu_ghost_limit_mib: 256          deleted files the tasks hold open (NCCL's /dev/shm segments) are dumped
                                     whole up to this size each (CRIU's --ghost-limit; its default is 1 MiB)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from migrt import trust
from migrt.errors import ConfigError
from migrt.runtime.lower import config_path, resolve

POLICIES = ("fail", "fresh")
LEVELS = ("debug", "info", "warning", "error")
CRIU_OPTION_KEYS = ("tcp_established", "ext_unix_sk", "file_locks", "shell_job")
GPU_KEYS = ("gpu_backend", "gpu_lock_timeout_ms", "gpu_hook_timeout_s", "gpu_peer_check", "gpu_checkpoint_thp")
GPU_PEER_CHECKS = ("refuse", "warn")
GPU_CHECKPOINT_THP = ("keep", "always")  # migrt/gpu/thp.py SETTINGS
GPU_BACKENDS = ("auto", "cuda", "none")
REGISTRY_KEYS = ("registry_auth_file", "registry_ca_file", "registry_parallel", "registry_timeout",
                 "restore_registries")
# host[:port] or [v6][:port]; wildcards (* ?) in the host, '*' for any port
_REGISTRY_PATTERN = re.compile(r"(?:[A-Za-z0-9*?](?:[A-Za-z0-9*?.-]*[A-Za-z0-9*?])?|\[[0-9a-fA-F:]+\])"
                               r"(?::(?:[0-9]{1,5}|\*))?")
RESTORE_PAGES = ("auto", "lazy", "eager")
PAGE_KEYS = ("restore_pages", "fill_threads", "fill_min_mib")
DUMP_PAGES = ("auto", "parallel", "criu")
DUMP_KEYS = ("dump_pages", "dump_threads", "criu_ghost_limit_mib")


@dataclass
class Config:
    path: str
    runtime: str = "runc"
    store: str = "/var/lib/migrt"
    restore_failure_policy: str = "fail"
    log_file: str = "/var/log/migrt/migrt.log"
    log_level: str = "info"
    runtime_roots: list[str] = field(default_factory=list)
    criu_options: dict[str, bool] = field(default_factory=dict)
    migration_key_file: str | None = None
    migration_tls: dict[str, str] | None = None
    migration_stall_timeout: float = 10.0
    migration_streams: int = 0
    pod_pull_deadline: float = 30.0
    agent_listen: str = "0.0.0.0:7070"
    migrate_any_container: bool = False
    migrate_peers: list[str] = field(default_factory=list)
    gpu_backend: str = "auto"
    gpu_lock_timeout_ms: int = 30_000
    gpu_hook_timeout_s: float = 30.0
    gpu_peer_check: str = "refuse"
    gpu_checkpoint_thp: str = "keep"
    allow_cross_namespace_restore: bool = False
    allow_unbound_checkpoints: bool = False
    store_space_check: bool = True
    registry_auth_file: str | None = None
    registry_ca_file: str | None = None
    registry_parallel: int = 4
    registry_timeout: float = 60.0
    restore_registries: list[str] = field(default_factory=list)
    restore_pages: str = "auto"
    fill_threads: int = 0
    fill_min_mib: int = 256
    dump_pages: str = "auto"
    dump_threads: int = 0
    criu_ghost_limit_mib: int = 256
    loaded: bool = False  # False when the file did not exist (defaults in use)

    def runtime_path(self) -> str:
        path = resolve(self.runtime)
        if not path:
            raise ConfigError(
                f"lower runtime {self.runtime!r} (config {self.path}) is not an executable file on PATH; "
                "install runc or set 'runtime:'"
            )
        trust.check(path, "lower runtime")  # it runs as root
        return path


_NOT_FLAT = object()
_BOOLS = {**dict.fromkeys(("true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"), True),
          **dict.fromkeys(("false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"), False)}
_NULLS = ("", "~", "null", "Null", "NULL")
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-")


def _flat_scalar(v: str):
    """A value as PyYAML's safe_load reads it, for the plain scalars a config has; _NOT_FLAT otherwise."""
    if v in _NULLS:
        return None
    if v in _BOOLS:
        return _BOOLS[v]
    if v in ("[]", "{}"):
        return [] if v == "[]" else {}
    if not set(v) <= _WORD:
        return _NOT_FLAT  # quotes, spaces, flow collections, anchors, tags...: YAML decides
    if v[0] in "0123456789+-.":  # numbers: only plain decimal integers here (YAML 1.1 octal, floats, dates...)
        return int(v) if v == "0" or (v[0] != "0" and v.isdigit()) else _NOT_FLAT
    return v


def _flat_yaml(text: str) -> dict | None:
    """The config when every line is blank, a comment or `key: plain scalar` at the left margin (what
    configs/config.yaml looks like), read without importing PyYAML (tens of ms on the restore path's
    start); None for anything else, which PyYAML reads. Same result as yaml.safe_load (a unit test
    compares them on generated files)."""
    out: dict = {}
    for line in text.split("\n"):
        body = line.rstrip(" \r")
        if "\t" in body:
            return None  # PyYAML refuses tabs in places; let it say so
        if not body or body.lstrip(" ").startswith("#"):
            continue
        key, sep, rest = body.partition(":")
        if not sep or not key or not (key[0].isalpha() or key[0] == "_") or not set(key) <= _WORD or key in out \
                or key in _BOOLS or key in _NULLS or (rest and rest[0] != " "):
            return None
        value = rest.strip(" ")
        if "#" in value:
            cut = value.find(" #")
            if cut < 0 and not value.startswith("#"):
                return None  # a '#' inside a word
            value = "" if value.startswith("#") else value[:cut].rstrip(" ")
        parsed = _flat_scalar(value)
        if parsed is _NOT_FLAT:
            return None
        out[key] = parsed
    return out or None


def _yaml_where(exc) -> str:
    """PyYAML's error in one line (its own text spans several, with a caret drawing): where and what."""
    mark = getattr(exc, "problem_mark", None)
    what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where}: {' '.join((what or str(exc)).split())}"


def load(path: str | None = None) -> Config:
    """Load and validate. A missing file means defaults; a broken one raises ConfigError."""
    path = path or config_path()
    cfg = Config(path=path)
    try:
        text = trust.read(path, "migrt config").decode("utf-8")  # Untrusted: another user could have written it
    except FileNotFoundError:
        return cfg
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {path}: cannot read: {exc}") from exc
    data = _flat_yaml(text)
    if data is None:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config {path}: invalid YAML{_yaml_where(exc)}") from exc
    cfg.loaded = True
    if data is None:
        return cfg
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping of keys, got {type(data).__name__}")
    known = {"runtime", "store", "restore_failure_policy", "log_file", "log_level", "runtime_roots", "criu_options",
             "allow_cross_namespace_restore", "allow_unbound_checkpoints", "migration_key_file", "migration_tls",
             "store_space_check",
             "migration_stall_timeout", "migration_streams", "agent_listen", "migrate_any_container",
             "migrate_peers", "pod_pull_deadline",
             "criu"}  # criu: read as one line by migrt.criu.binary (which CRIU migrt uses)
    known |= set(REGISTRY_KEYS)
    known |= set(GPU_KEYS) | set(PAGE_KEYS) | set(DUMP_KEYS)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config {path}: unknown key(s) {', '.join(map(str, unknown))}; "
                          f"known: {', '.join(sorted(known))}")
    for key in ("runtime", "store", "log_file"):
        if key in data:
            if not isinstance(data[key], str) or not data[key]:
                raise ConfigError(f"config {path}: '{key}' must be a non-empty string")
            setattr(cfg, key, data[key])
    if not os.path.isabs(cfg.store):
        raise ConfigError(f"config {path}: 'store' must be an absolute path, got {cfg.store!r}")
    _choose(cfg, data, path, "restore_failure_policy", POLICIES)
    _choose(cfg, data, path, "log_level", LEVELS)
    roots = data.get("runtime_roots", [])
    if not isinstance(roots, list) or not all(isinstance(r, str) and os.path.isabs(r) for r in roots):
        raise ConfigError(f"config {path}: 'runtime_roots' must be a list of absolute paths")
    cfg.runtime_roots = roots
    opts = data.get("criu_options", {}) or {}
    if not isinstance(opts, dict) or not all(k in CRIU_OPTION_KEYS and isinstance(v, bool) for k, v in opts.items()):
        raise ConfigError(f"config {path}: 'criu_options' keys must be among {CRIU_OPTION_KEYS} with true/false values")
    cfg.criu_options = opts
    _load_gpu(cfg, data, path)
    _load_pages(cfg, data, path)
    _load_dump(cfg, data, path)
    _flag(cfg, data, path, "allow_cross_namespace_restore")
    _flag(cfg, data, path, "allow_unbound_checkpoints")
    _flag(cfg, data, path, "store_space_check")
    key_file = data.get("migration_key_file")
    if key_file is not None and (not isinstance(key_file, str) or not os.path.isabs(key_file)):
        raise ConfigError(f"config {path}: 'migration_key_file' must be an absolute path")
    cfg.migration_key_file = key_file
    tls = data.get("migration_tls")
    if tls is not None and (not isinstance(tls, dict) or sorted(tls) != ["ca", "cert", "key"]
                            or not all(isinstance(v, str) and os.path.isabs(v) for v in tls.values())):
        raise ConfigError(f"config {path}: 'migration_tls' must map cert, key and ca to absolute paths")
    cfg.migration_tls = tls
    _load_registry(cfg, data, path)
    stall = data.get("migration_stall_timeout", cfg.migration_stall_timeout)
    if not isinstance(stall, (int, float)) or isinstance(stall, bool) or not 1 <= stall <= 3600:
        raise ConfigError(f"config {path}: 'migration_stall_timeout' must be a number of seconds from 1 to 3600")
    cfg.migration_stall_timeout = float(stall)
    streams = data.get("migration_streams", cfg.migration_streams)
    if not isinstance(streams, int) or isinstance(streams, bool) or not 0 <= streams <= 64:
        raise ConfigError(f"config {path}: 'migration_streams' must be an integer from 0 (auto) to 64")
    cfg.migration_streams = streams
    _load_agent(cfg, data, path)
    return cfg


def _choose(cfg: Config, data: dict, path: str, key: str, choices: tuple, hint: str = "") -> None:
    """cfg.<key> from data when it is one of choices (else its default); ConfigError otherwise."""
    value = data.get(key, getattr(cfg, key))
    if value not in choices:
        raise ConfigError(f"config {path}: '{key}' must be one of {choices}, got {value!r}"
                          + (f" {hint}" if hint else ""))
    setattr(cfg, key, value)


def _flag(cfg: Config, data: dict, path: str, key: str) -> None:
    """cfg.<key> from data when it is true or false (else its default); ConfigError otherwise."""
    value = data.get(key, getattr(cfg, key))
    if not isinstance(value, bool):
        raise ConfigError(f"config {path}: '{key}' must be true or false")
    setattr(cfg, key, value)


def _load_agent(cfg: Config, data: dict, path: str) -> None:
    listen = data.get("agent_listen", cfg.agent_listen)
    host, sep, port = str(listen).rpartition(":") if isinstance(listen, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"config {path}: 'agent_listen' must be ADDRESS:PORT (e.g. 0.0.0.0:7070), got {listen!r}")
    cfg.agent_listen = listen
    _flag(cfg, data, path, "migrate_any_container")
    _load_peers(cfg, data, path)
    deadline = data.get("pod_pull_deadline", cfg.pod_pull_deadline)
    if not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or not 1 <= deadline <= 600:
        raise ConfigError(f"config {path}: 'pod_pull_deadline' must be a number of seconds from 1 to 600")
    cfg.pod_pull_deadline = float(deadline)


def _load_peers(cfg: Config, data: dict, path: str) -> None:
    peers = data.get("migrate_peers", [])
    peers = [] if peers is None else peers
    if not isinstance(peers, list):
        raise ConfigError(f"config {path}: 'migrate_peers' must be a list of node agents as ADDRESS[:PORT] "
                          "(e.g. ['10.0.0.0/24', 'node-a.example:7070', '[fd00::/64]:*'])")
    if peers:
        from migrt.migrate_peers import parse_entry

        for entry in peers:
            try:
                parse_entry(entry)
            except ValueError as exc:
                raise ConfigError(f"config {path}: 'migrate_peers' entry {entry!r}: {exc}; entries are "
                                  "ADDRESS[:PORT], ADDRESS an IP, a CIDR block, a host name or '*.domain'") from None
    cfg.migrate_peers = peers


def _load_registry(cfg: Config, data: dict, path: str) -> None:
    for key in ("registry_auth_file", "registry_ca_file"):
        value = data.get(key)
        if value is not None and (not isinstance(value, str) or not os.path.isabs(value)):
            raise ConfigError(f"config {path}: '{key}' must be an absolute path")
        setattr(cfg, key, value)
    par = data.get("registry_parallel", cfg.registry_parallel)
    if not isinstance(par, int) or isinstance(par, bool) or not 1 <= par <= 32:
        raise ConfigError(f"config {path}: 'registry_parallel' must be an integer from 1 to 32")
    cfg.registry_parallel = par
    timeout = data.get("registry_timeout", cfg.registry_timeout)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 1 <= timeout <= 3600:
        raise ConfigError(f"config {path}: 'registry_timeout' must be a number of seconds from 1 to 3600")
    cfg.registry_timeout = float(timeout)
    allowed = data.get("restore_registries") or []
    if not isinstance(allowed, list) or not all(isinstance(a, str) and _REGISTRY_PATTERN.fullmatch(a) for a in allowed):
        raise ConfigError(f"config {path}: 'restore_registries' must be a list of registries as host[:port] "
                          "(e.g. [registry.example, '*.corp.example', '127.0.0.1:5000'])")
    cfg.restore_registries = allowed


def _load_gpu(cfg: Config, data: dict, path: str) -> None:
    _choose(cfg, data, path, "gpu_backend", GPU_BACKENDS)
    timeout = data.get("gpu_lock_timeout_ms", cfg.gpu_lock_timeout_ms)
    if not isinstance(timeout, int) or isinstance(timeout, bool) or not 0 <= timeout <= 3_600_000:
        raise ConfigError(f"config {path}: 'gpu_lock_timeout_ms' must be an integer from 0 (no timeout) to 3600000")
    cfg.gpu_lock_timeout_ms = timeout
    hook = data.get("gpu_hook_timeout_s", cfg.gpu_hook_timeout_s)
    if not isinstance(hook, (int, float)) or isinstance(hook, bool) or not 1 <= hook <= 3600:
        raise ConfigError(f"config {path}: 'gpu_hook_timeout_s' must be a number of seconds from 1 to 3600")
    cfg.gpu_hook_timeout_s = float(hook)
    _choose(cfg, data, path, "gpu_peer_check", GPU_PEER_CHECKS)
    _choose(cfg, data, path, "gpu_checkpoint_thp", GPU_CHECKPOINT_THP,
            hint="(always: transparent huge pages node-wide while the driver writes its checkpoint)")


def _load_pages(cfg: Config, data: dict, path: str) -> None:
    _choose(cfg, data, path, "restore_pages", RESTORE_PAGES)
    for key, top in (("fill_threads", 256), ("fill_min_mib", 1 << 30)):
        val = data.get(key, getattr(cfg, key))
        if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val <= top:
            raise ConfigError(f"config {path}: '{key}' must be an integer from 0 to {top}")
        setattr(cfg, key, val)


def _load_dump(cfg: Config, data: dict, path: str) -> None:
    _choose(cfg, data, path, "dump_pages", DUMP_PAGES)
    val = data.get("dump_threads", cfg.dump_threads)
    if not isinstance(val, int) or isinstance(val, bool) or not 0 <= val <= 256:
        raise ConfigError(f"config {path}: 'dump_threads' must be an integer from 0 to 256")
    cfg.dump_threads = val
    val = data.get("criu_ghost_limit_mib", cfg.criu_ghost_limit_mib)
    if isinstance(val, bool) or not isinstance(val, int) or not 1 <= val <= 1 << 20:
        raise ConfigError(f"config {path}: 'criu_ghost_limit_mib' must be an integer from 1 to {1 << 20}")
    cfg.criu_ghost_limit_mib = val
