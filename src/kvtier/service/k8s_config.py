"""`kvtier k8s serve-config`: each kustomize overlay's Ray Serve application args, generated from one service
config (src/kvtier/configs/*.yaml) plus the overlay's deployment-specific overrides.

k8s/serve-config-sources.yaml declares, per overlay, the source config and the overrides (a JSON merge
patch, RFC 7386: mappings merge key by key, `null` deletes a key, any other value, lists included, replaces).
The command writes the result into `applications[0].args` of k8s/overlays/<overlay>/serve-config.yaml and
leaves the rest of that file (comments, http_options, import_path, runtime_env ...) byte for byte; `--check`
only reports drift. Values are carried through as written (`max_num_seqs: auto`, `kv_cache_bytes: 64MiB`):
the args are validated with ServiceConfig, never replaced by its parsed form.

k8s/base/serve-config.yaml is not generated: its args are the base's own (no configs/ file has its shape)
and every overlay replaces the file.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import typer
import yaml

REPO = Path(__file__).resolve().parents[3]      # the checkout (src/kvtier/service/k8s_config.py)
SOURCES = Path("k8s") / "serve-config-sources.yaml"
OVERLAYS = Path("k8s") / "overlays"
COMMAND = "kvtier k8s serve-config"


class K8sConfigError(ValueError):
    """A declaration or an override that cannot produce valid args; the message says where."""


@dataclass(frozen=True)
class Overlay:
    name: str
    source: Path                 # relative to the repository root
    overrides: dict[str, Any]

    def serve_config(self, root: Path) -> Path:
        return root / OVERLAYS / self.name / "serve-config.yaml"


# -- declarations -------------------------------------------------------------------------------------
def load_overlays(root: Path = REPO) -> dict[str, Overlay]:
    path = root / SOURCES
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise K8sConfigError(f"cannot read {path}: {exc.strerror} (run from a kvtier checkout)") from None
    overlays = (data or {}).get("overlays")
    if not isinstance(overlays, dict) or not overlays:
        raise K8sConfigError(f"{path}: expected a mapping `overlays: {{<name>: {{source, overrides}}}}`")
    out = {}
    for name, decl in overlays.items():
        if not isinstance(decl, dict) or not isinstance(decl.get("source"), str):
            raise K8sConfigError(f"{path}: overlays.{name}: `source: src/kvtier/configs/<file>.yaml` is required")
        if extra := sorted(set(decl) - {"source", "overrides"}):
            raise K8sConfigError(f"{path}: overlays.{name}: unknown keys {extra} (source, overrides)")
        overrides = decl.get("overrides") or {}
        if not isinstance(overrides, dict):
            raise K8sConfigError(f"{path}: overlays.{name}.overrides must be a mapping")
        out[name] = Overlay(name, Path(decl["source"]), overrides)
    return out


# -- args ---------------------------------------------------------------------------------------------
def merge_patch(target: Any, patch: Any, where: str = "") -> Any:
    """RFC 7386 merge patch; an override that changes nothing (same value, or null on a missing key) is an
    error, so overrides cannot silently go stale when the source config changes."""
    if not isinstance(patch, dict) or not isinstance(target, dict):
        if patch == target:
            raise K8sConfigError(f"override {where or '<root>'}: the source already has {patch!r}; drop it")
        return copy.deepcopy(patch)
    out = dict(target)
    for key, value in patch.items():
        at = f"{where}.{key}" if where else str(key)
        if value is None:
            if key not in out:
                raise K8sConfigError(f"override {at}: null deletes a key the source does not have; drop it")
            del out[key]
        else:
            out[key] = merge_patch(out[key], value, at) if key in out else copy.deepcopy(value)
    return out


def load_source(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise K8sConfigError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise K8sConfigError(f"{path}: expected a service config mapping")
    return data


def generate_args(overlay: Overlay, root: Path = REPO, source: Path | None = None) -> dict[str, Any]:
    """The overlay's ServiceConfig args: the source config with the overrides applied, validated."""
    from .config import ConfigError, parse_config

    src = source if source is not None else root / overlay.source
    args = merge_patch(load_source(src), overlay.overrides, "")
    try:
        cfg = parse_config(args, f"{src} + overlays.{overlay.name}.overrides")
    except ConfigError as exc:
        raise K8sConfigError(str(exc)) from None
    for name, tenant in cfg.tenants.items():
        if tenant.api_keys:
            raise K8sConfigError(f"overlay {overlay.name}: tenant {name!r} lists api_keys; keys belong in the "
                                 "Secret kvtier-api-keys (api_keys_env), never in a manifest")
    return args


# -- serve-config.yaml --------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    """Block style with indented sequences; lists of scalars in flow style ([full, k1024])."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def _represent_list(dumper, data):
    flow = bool(data) and all(isinstance(v, (str, int, float, bool)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_args(args: dict[str, Any]) -> str:
    return yaml.dump(args, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120,
                     allow_unicode=True)


def _args_span(text: str, path: Path) -> tuple[int, int, int]:
    """(first line, end line, indent) of `applications[0].args` (key line through its value) in the file."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise K8sConfigError(f"{path}: invalid YAML: {exc}") from None

    def get(node, key):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == key:
                    return k, v
        return None, None

    _, apps = get(root, "applications")
    if not isinstance(apps, yaml.SequenceNode) or len(apps.value) != 1:
        raise K8sConfigError(f"{path}: expected exactly one entry under `applications`")
    key, value = get(apps.value[0], "args")
    if key is None:
        raise K8sConfigError(f"{path}: applications[0] has no `args` to replace")
    lines = text.splitlines(keepends=True)
    end = value.end_mark
    before = lines[end.line][:end.column] if end.line < len(lines) else ""
    stop = end.line if not before.strip() else end.line + 1
    # comment or blank lines at (or left of) the key's indentation belong to what follows the args
    while stop > value.start_mark.line + 1 and (
            not lines[stop - 1].strip()
            or (lines[stop - 1].lstrip().startswith("#")
                and len(lines[stop - 1]) - len(lines[stop - 1].lstrip()) <= key.start_mark.column)):
        stop -= 1
    return key.start_mark.line, stop, key.start_mark.column


def render(overlay: Overlay, root: Path = REPO, source: Path | None = None) -> tuple[str, str]:
    """(current text, generated text) of the overlay's serve-config.yaml."""
    path = overlay.serve_config(root)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise K8sConfigError(f"cannot read {path}: {exc.strerror} (the overlay keeps its serve-config.yaml; "
                             "the command only fills in applications[0].args)") from None
    args = generate_args(overlay, root, source)
    first, stop, indent = _args_span(text, path)
    pad = " " * indent
    src = source if source is not None else overlay.source
    block = (f"{pad}args:\n"
             f"{pad}  # generated by `{COMMAND}` from {src} + overrides in {SOURCES}:\n"
             f"{pad}  # edit those, not this block (tests/test_k8s.py fails when it drifts)\n"
             + "".join(f"{pad}  {line}\n" if line else "\n" for line in dump_args(args).splitlines()))
    lines = text.splitlines(keepends=True)
    new = "".join(lines[:first]) + block + "".join(lines[stop:])
    _check_rendered(text, new, args, path)
    return text, new


def _check_rendered(old: str, new: str, args: dict[str, Any], path: Path) -> None:
    """The splice changed args only, and the args agree with the Serve config around them."""
    before, after = yaml.safe_load(old), yaml.safe_load(new)
    app = after["applications"][0]
    if app.get("args") != args:
        raise K8sConfigError(f"{path}: internal error, the written args do not read back equal")
    before["applications"][0]["args"] = args
    if before != after:
        raise K8sConfigError(f"{path}: internal error, the splice changed more than applications[0].args")
    server = args.get("server", {})
    if server.get("app_name", "kvtier") != app.get("name"):
        raise K8sConfigError(f"{path}: server.app_name {server.get('app_name', 'kvtier')!r} is not the "
                             f"application name {app.get('name')!r}; add an override")
    port = (after.get("http_options") or {}).get("port")
    if port is not None and server.get("port", 8000) != port:
        raise K8sConfigError(f"{path}: server.port {server.get('port', 8000)} is not http_options.port {port}; "
                             "add an override")


def stale(root: Path = REPO, names: list[str] | None = None) -> list[tuple[Overlay, str, str]]:
    """(overlay, current, generated) of every overlay whose serve-config.yaml is out of date."""
    overlays = load_overlays(root)
    out = []
    for name in names or sorted(overlays):
        current, generated = render(overlays[name], root)
        if current != generated:
            out.append((overlays[name], current, generated))
    return out


# -- CLI ----------------------------------------------------------------------------------------------
k8s_app = typer.Typer(no_args_is_help=True, help="Kubernetes manifests: generated parts of the kustomize overlays.")


@k8s_app.command("serve-config")
def serve_config_cmd(
    overlay: Optional[list[str]] = typer.Option(None, "--overlay", "-o",
                                                help="Overlay name (k8s/overlays/<name>); repeat for several. "
                                                     "Default: every overlay declared in " + str(SOURCES) + "."),
    config: Optional[Path] = typer.Option(None, "--config", "-c",
                                          help="Source service config. Default: the overlay's declared source; "
                                               "another file only with --stdout (a preview)."),
    check: bool = typer.Option(False, "--check", help="Write nothing; exit 1 (with a diff) if a file is stale."),
    stdout: bool = typer.Option(False, "--stdout", help="Print the generated serve-config.yaml instead of writing."),
) -> None:
    """Generate each overlay's serve-config.yaml `applications[0].args` from its src/kvtier/configs/*.yaml source
    plus the overrides declared in k8s/serve-config-sources.yaml."""
    try:
        overlays = load_overlays(REPO)
        names = list(overlay or sorted(overlays))
        if unknown := sorted(set(names) - set(overlays)):
            raise K8sConfigError(f"unknown overlay(s) {unknown}; declared in {SOURCES}: {sorted(overlays)}")
        source = None
        if config is not None:
            if len(names) != 1:
                raise K8sConfigError("--config needs exactly one --overlay")
            declared = overlays[names[0]].source
            if config.resolve() != (REPO / declared).resolve() and not stdout:
                raise K8sConfigError(f"overlay {names[0]} is generated from {declared} ({SOURCES}); change the "
                                     "declaration to change its source, or preview another config with --stdout")
            source = config
        results = [(overlays[n], *render(overlays[n], REPO, source)) for n in names]
    except K8sConfigError as exc:
        typer.echo(f"{COMMAND}: {exc}", err=True)
        raise typer.Exit(2) from None
    drift = 0
    for ov, current, generated in results:
        rel = ov.serve_config(Path("."))
        if stdout:
            typer.echo(generated, nl=False)
        elif current == generated:
            typer.echo(f"{rel}: up to date")
        elif check:
            drift += 1
            typer.echo("".join(difflib.unified_diff(current.splitlines(keepends=True),
                                                    generated.splitlines(keepends=True),
                                                    f"{rel} (committed)", f"{rel} (generated)")))
        else:
            ov.serve_config(REPO).write_text(generated, encoding="utf-8")
            typer.echo(f"{rel}: written (from {ov.source})")
    if drift:
        typer.echo(f"{drift} overlay serve config(s) out of date: run `{COMMAND}`", err=True)
        raise typer.Exit(1)
