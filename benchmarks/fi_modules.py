"""FlashInfer's JIT-built kernel modules, packed on one GPU machine and installed on the next, so that a fresh
machine loads them instead of running nvcc again.

    python3 benchmarks/fi_modules.py pack --out DIR [--max-file-mb 15] [--max-total-mb N] [--only GLOB,...]
    python3 benchmarks/fi_modules.py install DIR [--aot-dir PATH] [--force]
    python3 benchmarks/fi_modules.py list [DIR]

How FlashInfer finds a module (its ``flashinfer/jit/core.py`` and ``jit/env.py``): every kernel module is a
``JitSpecNvcc`` whose ``build_and_load()`` first calls ``try_load()``, which loads only an *AOT* artifact: the
file ``<flashinfer package>/data/aot/<name>/<name>.so`` (``jit_env.get_aot_artifacts``, the fallback path that
is taken as soon as it exists, with no architecture check), or one listed by an installed
``flashinfer_jit_cache`` package. Anything else goes through ``build()``, which always writes ``build.ninja`` and
runs ninja in ``~/.cache/flashinfer/<version>/<arch>/cached_ops/<name>/`` (``FLASHINFER_WORKSPACE_BASE``
replaces ``~``); on a fresh machine the generated sources are written anew, newer than any copied object, so
a copied JIT cache (objects, ``build.ninja``, ninja's logs) would compile again. The smallest set that loads
without nvcc or ninja is therefore the one ``.so`` per module, placed in ``data/aot``; this tool packs exactly
those from the JIT cache and installs them there.
FlashInfer does not check an AOT ``.so`` against the GPU, so ``install`` does: FlashInfer's version and the
target architecture must match the manifest's.

``pack`` writes ``fi-modules.tar.gz.NNN`` (one gzip tar stream cut into parts of at most ``--max-file-mb``, so
a module larger than a part still travels) and ``fi-modules.json`` (the manifest: FlashInfer's version, the
architecture, torch / CUDA / tvm-ffi versions, each module's size, sha256 and build time read from ninja's log).
``install`` checks the parts' sha256, FlashInfer's version and the architecture, then unpacks the ``.so`` files.
With ``FLASHINFER_DISABLE_JIT=1`` FlashInfer raises instead of compiling a module that is missing.

This module imports neither torch nor FlashInfer unless it must (the architecture of the GPU, versions for
the manifest): ``list`` and the packing logic run anywhere.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import importlib.util
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zlib

MANIFEST = "fi-modules.json"
PART_PREFIX = "fi-modules.tar.gz."
INSTALLED_MANIFEST = "fi_modules_manifest.json"  # the copy kept in the AOT folder, for `list`
FORMAT = 1
MIB = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


class Refused(RuntimeError):
    """A pack that would not load here: the message says what differs."""


# ----------------------------------------------------------------------------- where FlashInfer keeps things


def flashinfer_dir() -> pathlib.Path | None:
    """The ``flashinfer`` package folder on ``sys.path`` (found, not imported), or None."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def flashinfer_version(pkg: pathlib.Path) -> str | None:
    """``__version__`` of the package at ``pkg``, read from ``_build_meta.py`` (what ``flashinfer.version`` does)."""
    meta = pkg / "_build_meta.py"
    if not meta.is_file():
        return None
    m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", meta.read_text(), re.M)
    return m.group(1) if m else None


def cache_root() -> pathlib.Path:
    """``FLASHINFER_CACHE_DIR`` of ``flashinfer/jit/env.py``: ``$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer``."""
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(pathlib.Path.home())
    return pathlib.Path(base) / ".cache" / "flashinfer"


def _arch_pair(major: int, minor: str) -> tuple[int, str]:
    """FlashInfer's ``CompilationContext._normalize_cuda_arch`` for the common cases: an explicit suffix is kept,
    9.x and 10+ take ``a``; 12.0 takes ``f`` (CUDA 12.9+, the only toolkits that build 0.7 for it)."""
    if minor[-1:].isalpha():
        return major, minor
    if major == 12 and minor == "0":
        return major, "0f"
    if major >= 9:
        return major, minor + "a"
    return major, minor


def arch_key(pairs) -> str:
    """The workspace folder name FlashInfer derives from its target architectures, e.g. ``90a``."""
    return "_".join(f"{major}{minor}" for major, minor in sorted(set(pairs)))


def arch_from_list(arch_list: str) -> str:
    """``FLASHINFER_CUDA_ARCH_LIST`` ("9.0a", "8.0 9.0a") as the workspace folder name."""
    pairs = []
    for item in arch_list.split():
        major, minor = item.split(".")
        pairs.append(_arch_pair(int(major), minor))
    return arch_key(pairs)


def target_arch() -> str:
    """The architecture key FlashInfer would build for in this process: ``FLASHINFER_CUDA_ARCH_LIST`` when set,
    else every visible GPU (imports torch)."""
    if os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        return arch_from_list(os.environ["FLASHINFER_CUDA_ARCH_LIST"])
    import torch

    if not torch.cuda.is_available():
        raise Refused("no CUDA device and no FLASHINFER_CUDA_ARCH_LIST: cannot tell which architecture to check")
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return arch_key(_arch_pair(major, str(minor)) for major, minor in caps)


# ----------------------------------------------------------------------------- what was built


def _ninja_times(folder: pathlib.Path) -> dict:
    """``{output path: seconds}`` from a ``.ninja_log`` (``start_ms end_ms mtime output hash`` per line)."""
    log = folder / ".ninja_log"
    out = {}
    if not log.is_file():
        return out
    for line in log.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if line.startswith("#") or len(fields) < 4:
            continue
        try:
            out[fields[3]] = (int(fields[0]), int(fields[1]))
        except ValueError:
            continue
    return out


def build_seconds(ops: pathlib.Path, name: str) -> float | None:
    """Wall seconds ninja spent on module ``name`` (first compile start to link end), from its log or the shared
    log of a ``build_jit_specs`` run; None when no log names it."""
    spans = []
    for folder in (ops / name, ops):
        for path, span in _ninja_times(folder).items():
            parts = pathlib.PurePath(path).parts
            if folder == ops / name or (len(parts) >= 2 and parts[-2] == name):
                spans.append(span)
    if not spans:
        return None
    return round((max(e for _, e in spans) - min(s for s, _ in spans)) / 1000.0, 1)


def _is_complete_elf(path: pathlib.Path) -> bool:
    """A 64-bit ELF file whose section header table (written last by the linker) lies inside the file: a link
    stopped half-way leaves a shorter file."""
    with open(path, "rb") as f:
        head = f.read(64)
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        return False
    order = "little" if head[5] == 1 else "big"
    shoff = int.from_bytes(head[0x28:0x30], order)
    shentsize, shnum = int.from_bytes(head[0x3A:0x3C], order), int.from_bytes(head[0x3C:0x3E], order)
    return shoff > 0 and shoff + shentsize * shnum <= path.stat().st_size


def gz_size(path: pathlib.Path) -> int:
    """Bytes of ``path`` gzip-compressed as ``pack`` compresses it (level 6)."""
    z = zlib.compressobj(6, zlib.DEFLATED, 31)
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            n += len(z.compress(block))
    return n + len(z.flush())


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def built_modules(ops: pathlib.Path) -> list:
    """``[{name, path, size, build_s}]`` for each ``cached_ops/<name>/<name>.so`` that is a complete ELF file (a
    failed build has none, a build stopped during its link a truncated one)."""
    mods = []
    if not ops.is_dir():
        return mods
    for d in sorted(ops.iterdir()):
        so = d / f"{d.name}.so"
        if d.is_dir() and _NAME.match(d.name) and so.is_file() and _is_complete_elf(so):
            mods.append(dict(name=d.name, path=so, size=so.stat().st_size, build_s=build_seconds(ops, d.name)))
    return mods


def select_modules(mods: list, only=None, max_total_bytes: int | None = None) -> tuple[list, list]:
    """(kept, dropped): ``only`` (glob patterns) filters by name; under ``max_total_bytes`` of packed size
    (``packed``, else ``size``, plus a tar header each), the modules that saved the most build seconds per byte
    are kept first (an unknown build time counts as 60 s)."""
    kept = [m for m in mods if not only or any(fnmatch.fnmatchcase(m["name"], p) for p in only)]
    dropped = []
    if max_total_bytes is not None:

        def cost(m):
            return m.get("packed", m["size"]) + 1024

        ranked = sorted(kept, key=lambda m: -((m["build_s"] or 60.0) / cost(m)))
        kept, total = [], 0
        for m in ranked:
            if total + cost(m) <= max_total_bytes:
                kept.append(m)
                total += cost(m)
            else:
                dropped.append(m)
        kept.sort(key=lambda m: m["name"])
    return kept, dropped


# ----------------------------------------------------------------------------- parts


class PartWriter(io.RawIOBase):
    """A write-only stream cut into ``<prefix>000``, ``001``, ... of at most ``limit`` bytes each."""

    def __init__(self, folder: pathlib.Path, prefix: str, limit: int):
        super().__init__()
        self.folder, self.prefix, self.limit = folder, prefix, limit
        self.paths: list = []
        self._f = None
        self._n = 0

    def writable(self):
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._f is None or self._n >= self.limit:
                self._next()
            take = min(self.limit - self._n, len(view) - done)
            self._f.write(view[done : done + take])
            self._n += take
            done += take
        return done

    def _next(self):
        if self._f is not None:
            self._f.close()
        path = self.folder / f"{self.prefix}{len(self.paths):03d}"
        self.paths.append(path)
        self._f = open(path, "wb")  # noqa: SIM115 (closed by _next or close)
        self._n = 0

    def close(self):
        if self._f is not None:
            self._f.close()
            self._f = None
        super().close()


class PartReader(io.RawIOBase):
    """The parts read back as one stream."""

    def __init__(self, paths):
        super().__init__()
        self._paths = list(paths)
        self._f = None

    def readable(self):
        return True

    def readinto(self, buf) -> int:
        while True:
            if self._f is None:
                if not self._paths:
                    return 0
                self._f = open(self._paths.pop(0), "rb")  # noqa: SIM115 (closed at its end or by close)
            n = self._f.readinto(buf)
            if n:
                return n
            self._f.close()
            self._f = None

    def close(self):
        if self._f is not None:
            self._f.close()
        super().close()


# ----------------------------------------------------------------------------- versions for the manifest


def _versions() -> dict:
    """torch, its CUDA, nvcc's release and tvm-ffi, each None where it cannot be read here."""
    out = dict(torch=None, torch_cuda=None, nvcc=None, tvm_ffi=None, gpu=None)
    try:
        import torch

        out["torch"], out["torch_cuda"] = torch.__version__, torch.version.cuda
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    try:
        from importlib.metadata import version

        out["tvm_ffi"] = version("apache-tvm-ffi")
    except Exception:
        pass
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    try:
        txt = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"release (\d+\.\d+)", txt)
        out["nvcc"] = m.group(1) if m else None
    except Exception:
        pass
    return out


# ----------------------------------------------------------------------------- pack / install / list


def pack(
    out: pathlib.Path,
    cache: pathlib.Path | None = None,
    version: str | None = None,
    arch: str | None = None,
    max_file_mb: float = 15,
    max_total_mb: float | None = None,
    only=None,
    versions: dict | None = None,
) -> dict:
    """Pack the ``.so`` of each module built in ``<cache>/<version>/<arch>/cached_ops`` into ``out``; returns the
    manifest. ``version`` defaults to the importable FlashInfer's (else the only version folder), ``arch`` to
    ``FLASHINFER_CUDA_ARCH_LIST``'s (else the only architecture folder)."""
    cache = cache or cache_root()
    if version is None:
        pkg = flashinfer_dir()
        version = flashinfer_version(pkg) if pkg else None
    if version is None:
        found = sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name[:1].isdigit()) if cache.is_dir() else []
        if len(found) != 1:
            raise Refused(f"cannot tell which FlashInfer version to pack from {cache}: {found or 'none'} (--version)")
        version = found[0]
    if arch is None and os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        arch = arch_from_list(os.environ["FLASHINFER_CUDA_ARCH_LIST"])
    if arch is None:
        found = sorted(p.name for p in (cache / version).iterdir() if p.is_dir()) if (cache / version).is_dir() else []
        found = [a for a in found if (cache / version / a / "cached_ops").is_dir()]
        if len(found) != 1:
            raise Refused(f"cannot tell which architecture to pack under {cache / version}: {found or 'none'} (--arch)")
        arch = found[0]
    ops = cache / version / arch / "cached_ops"
    mods = built_modules(ops)
    if not mods:
        raise Refused(f"no built module (cached_ops/<name>/<name>.so) under {ops}")
    limit = None if max_total_mb is None else int(max_total_mb * MIB)
    for m in mods:
        if not only or any(fnmatch.fnmatchcase(m["name"], p) for p in only):
            m["packed"] = gz_size(m["path"])
    kept, dropped = select_modules(mods, only, limit)
    if not kept:
        raise Refused(f"no module left to pack ({len(mods)} built, none selected)")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(PART_PREFIX + "*"):
        old.unlink()
    writer = PartWriter(out, PART_PREFIX, int(max_file_mb * MIB))
    with writer, tarfile.open(fileobj=writer, mode="w|gz") as tar:
        for m in kept:
            info = tar.gettarinfo(str(m["path"]), arcname=f"{m['name']}/{m['name']}.so")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755
            with open(m["path"], "rb") as f:
                tar.addfile(info, f)
    manifest = dict(
        format=FORMAT,
        flashinfer_version=version,
        cuda_arch=arch,
        **(versions if versions is not None else _versions()),
        modules=[
            dict(name=m["name"], size=m["size"], packed=m["packed"], sha256=_sha256(m["path"]), build_s=m["build_s"])
            for m in kept
        ],
        left_out=[dict(name=m["name"], size=m["size"], packed=m["packed"], build_s=m["build_s"]) for m in dropped],
        parts=[dict(file=p.name, size=p.stat().st_size, sha256=_sha256(p)) for p in writer.paths],
    )
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(folder: pathlib.Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise Refused(f"{path} is missing: not a folder written by `fi_modules.py pack`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise Refused(f"{path}: format {manifest.get('format')}, this tool reads {FORMAT}")
    return manifest


def check(manifest: dict, version: str | None, arch: str, versions: dict | None = None) -> list:
    """Raise ``Refused`` when FlashInfer's version or the architecture differs from the manifest's (the modules
    would load and then fail or misbehave); return warnings for the softer differences (torch, tvm-ffi)."""
    problems = []
    if version != manifest["flashinfer_version"]:
        problems.append(
            f"FlashInfer here is {version or 'not found'}, the modules were built by {manifest['flashinfer_version']}"
        )
    if arch != manifest["cuda_arch"]:
        problems.append(
            f"the target architecture here is {arch}, the modules were built for {manifest['cuda_arch']} "
            "(set FLASHINFER_CUDA_ARCH_LIST to match the GPU, or rebuild)"
        )
    versions = versions or {}
    built_cuda, here_cuda = manifest.get("torch_cuda"), versions.get("torch_cuda")
    if built_cuda and here_cuda and built_cuda.split(".")[0] != here_cuda.split(".")[0]:
        problems.append(f"CUDA {here_cuda} here, {built_cuda} at build time (libcudart's major differs)")
    if problems:
        raise Refused("refusing to install FlashInfer modules: " + "; ".join(problems))
    warnings = []
    for key in ("torch", "tvm_ffi", "nvcc"):
        if manifest.get(key) and versions.get(key) and manifest[key] != versions[key]:
            warnings.append(f"{key} {versions[key]} here, {manifest[key]} at build time")
    return warnings


def install(
    folder: pathlib.Path,
    aot_dir: pathlib.Path | None = None,
    version: str | None = None,
    arch: str | None = None,
    force: bool = False,
    versions: dict | None = None,
) -> list:
    """Check and unpack the modules of ``folder`` into FlashInfer's AOT folder (``<package>/data/aot`` by
    default); returns the names installed."""
    manifest = read_manifest(folder)
    pkg = flashinfer_dir()
    if version is None:
        version = flashinfer_version(pkg) if pkg else None
    if aot_dir is None:
        if pkg is None:
            raise Refused("FlashInfer is not importable here (add the staged FlashInfer to PYTHONPATH first)")
        aot_dir = pkg / "data" / "aot"
    if arch is None:
        arch = target_arch()
    parts = [folder / p["file"] for p in manifest["parts"]]
    for p, want in zip(parts, manifest["parts"]):
        if not p.is_file() or p.stat().st_size != want["size"] or _sha256(p) != want["sha256"]:
            raise Refused(f"{p} is missing or differs from the manifest (a part lost in transfer?)")
    try:
        for w in check(manifest, version, arch, versions if versions is not None else _versions()):
            print(f"[fi_modules] warning: {w}", file=sys.stderr)
    except Refused:
        if not force:
            raise
        print("[fi_modules] --force: installing despite the mismatch", file=sys.stderr)
    wanted = {f"{m['name']}/{m['name']}.so": m for m in manifest["modules"]}
    aot_dir.mkdir(parents=True, exist_ok=True)
    names = []
    with PartReader(parts) as reader, tarfile.open(fileobj=reader, mode="r|gz") as tar:
        for info in tar:
            m = wanted.get(info.name)
            if m is None or not info.isfile() or not _NAME.match(m["name"]):
                raise Refused(f"unexpected member {info.name!r} in the parts")
            dest = aot_dir / m["name"] / f"{m['name']}.so"
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(".so.part")
            with tar.extractfile(info) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, MIB)
            if _sha256(tmp) != m["sha256"]:
                tmp.unlink()
                raise Refused(f"{info.name}: sha256 differs from the manifest")
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest)
            names.append(m["name"])
    missing = sorted(set(m["name"] for m in manifest["modules"]) - set(names))
    if missing:
        raise Refused(f"the parts lack {missing}")
    (aot_dir / INSTALLED_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return names


def installed(aot_dir: pathlib.Path) -> list:
    """``[(name, size)]`` of the AOT modules FlashInfer would load from ``aot_dir``."""
    if not aot_dir.is_dir():
        return []
    return [
        (d.name, (d / f"{d.name}.so").stat().st_size)
        for d in sorted(aot_dir.iterdir())
        if d.is_dir() and (d / f"{d.name}.so").is_file()
    ]


def _mb(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def _secs(s: float | None) -> str:
    return "? s (no ninja log)" if s is None else f"{s} s"


def _print_manifest(m: dict) -> None:
    total = sum(x["size"] for x in m["modules"])
    print(
        f"FlashInfer {m['flashinfer_version']}, {m['cuda_arch']}; torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), "
        f"nvcc {m.get('nvcc')}, tvm-ffi {m.get('tvm_ffi')}, {m.get('gpu')}"
    )
    parts = sum(p["size"] for p in m["parts"])
    print(f"{len(m['modules'])} modules, {_mb(total)} ({_mb(parts)} in {len(m['parts'])} parts)")
    for x in m["modules"]:
        print(f"  {x['name']}  {_mb(x['size'])} ({_mb(x['packed'])} packed)  built in {_secs(x['build_s'])}")
    for x in m.get("left_out", []):
        print(f"  left out: {x['name']}  {_mb(x['size'])} ({_mb(x['packed'])} packed)  built in {_secs(x['build_s'])}")


def list_cmd(folder: pathlib.Path | None, aot_dir: pathlib.Path | None, cache: pathlib.Path | None) -> None:
    if folder is not None:
        _print_manifest(read_manifest(folder))
        return
    pkg = flashinfer_dir()
    version = flashinfer_version(pkg) if pkg else None
    print(f"FlashInfer: {version or 'not importable'}" + (f" ({pkg})" if pkg else ""))
    aot_dir = aot_dir or (pkg / "data" / "aot" if pkg else None)
    if aot_dir is not None:
        mods = installed(aot_dir)
        print(f"loaded without building ({aot_dir}): {len(mods)} modules, {_mb(sum(s for _, s in mods))}")
        for name, size in mods:
            print(f"  {name}  {_mb(size)}")
        if (aot_dir / INSTALLED_MANIFEST).is_file():
            m = json.loads((aot_dir / INSTALLED_MANIFEST).read_text())
            print(f"  installed from a pack of FlashInfer {m['flashinfer_version']} for {m['cuda_arch']}")
    cache = cache or cache_root()
    if version and (cache / version).is_dir():
        for arch_dir in sorted((cache / version).iterdir()):
            mods = built_modules(arch_dir / "cached_ops")
            if mods:
                total = sum(m["size"] for m in mods)
                print(f"JIT cache {arch_dir.name} ({arch_dir / 'cached_ops'}): {len(mods)} built, {_mb(total)}")
                for m in mods:
                    print(f"  {m['name']}  {_mb(m['size'])}  built in {_secs(m['build_s'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="pack the built modules' .so files into parts and a manifest")
    p.add_argument("--out", required=True, type=pathlib.Path)
    p.add_argument("--max-file-mb", type=float, default=15, help="largest part, MiB (default 15)")
    p.add_argument(
        "--max-total-mb",
        type=float,
        default=None,
        help="keep the modules that saved the most build time per MiB within this many MiB of parts (gzip)",
    )
    p.add_argument("--only", default=None, help="comma-separated glob patterns of module names")
    p.add_argument("--cache-dir", type=pathlib.Path, default=None, help="default: FlashInfer's (~/.cache/flashinfer)")
    p.add_argument("--version", default=None, help="FlashInfer version folder (default: the importable one's)")
    p.add_argument("--arch", default=None, help="architecture folder, e.g. 90a (default: FLASHINFER_CUDA_ARCH_LIST's)")
    i = sub.add_parser("install", help="check a pack against this machine and install it where FlashInfer looks")
    i.add_argument("folder", type=pathlib.Path)
    i.add_argument("--aot-dir", type=pathlib.Path, default=None, help="default: <flashinfer package>/data/aot")
    i.add_argument("--arch", default=None, help="the architecture key to check against (default: this machine's)")
    i.add_argument("--force", action="store_true", help="install despite a version or architecture mismatch")
    lp = sub.add_parser("list", help="a pack's manifest, or what FlashInfer here would load and has built")
    lp.add_argument("folder", type=pathlib.Path, nargs="?", default=None)
    lp.add_argument("--aot-dir", type=pathlib.Path, default=None)
    lp.add_argument("--cache-dir", type=pathlib.Path, default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            only = [s for s in args.only.split(",") if s] if args.only else None
            m = pack(args.out, args.cache_dir, args.version, args.arch, args.max_file_mb, args.max_total_mb, only)
            _print_manifest(m)
        elif args.cmd == "install":
            names = install(args.folder, args.aot_dir, arch=args.arch, force=args.force)
            print(f"[fi_modules] installed {len(names)} FlashInfer modules")
        else:
            list_cmd(args.folder, args.aot_dir, args.cache_dir)
    except Refused as e:
        print(f"[fi_modules] {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
