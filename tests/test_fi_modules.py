"""benchmarks/fi_modules.py on a fake FlashInfer JIT cache: parts within the size limit, a manifest that says
what was built for what, a round trip into the AOT folder FlashInfer loads from, and refusals on a mismatch."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSION = "0.7.2.post1"
MIB = 1 << 20


@pytest.fixture(scope="module")
def fim():
    spec = importlib.util.spec_from_file_location("fi_modules", ROOT / "benchmarks" / "fi_modules.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _elf(size: int, random: bool) -> bytes:
    """A 64-bit little-endian ELF header whose 4 section headers end the ``size`` bytes, as a linker writes them."""
    body = os.urandom(size - 64) if random else bytes(size - 64)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    head[0x28:0x30] = (size - 4 * 64).to_bytes(8, "little")  # e_shoff
    head[0x3A:0x3C] = (64).to_bytes(2, "little")  # e_shentsize
    head[0x3C:0x3E] = (4).to_bytes(2, "little")  # e_shnum
    return bytes(head) + body


def _so(path: pathlib.Path, size: int, random: bool) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _elf(size, random)
    path.write_bytes(data)
    return data


@pytest.fixture
def cache(tmp_path):
    """``<base>/.cache/flashinfer/<version>/90a/cached_ops`` with two built modules, a failed build (no .so), an
    empty and a truncated .so; ``norm`` has ninja's log."""
    ops = tmp_path / "base" / ".cache" / "flashinfer" / VERSION / "90a" / "cached_ops"
    big = "batch_prefill_fa3_head_dim_128"
    data = {big: _so(ops / big / f"{big}.so", 2 * MIB + 123, 1), "norm": _so(ops / "norm" / "norm.so", 300_000, 0)}
    (ops / "failed").mkdir()
    (ops / "failed" / "build.ninja").write_text("rule x\n")
    (ops / "empty").mkdir()
    (ops / "empty" / "empty.so").write_bytes(b"")
    (ops / "cut").mkdir()
    (ops / "cut" / "cut.so").write_bytes(_elf(100_000, False)[:60_000])  # a link stopped half-way
    (ops / "tmp").mkdir()  # FlashInfer's lock folder
    (ops / "norm" / ".ninja_log").write_text(
        "# ninja log v5\n"
        "1000\t31000\t0\t/x/cached_ops/norm/norm.cuda.o\t9\n"
        "31000\t33500\t0\t/x/cached_ops/norm/norm.so\t8\n"
    )
    return tmp_path / "base" / ".cache" / "flashinfer", data


VERSIONS = dict(torch="2.11.0+cu130", torch_cuda="13.0", nvcc="13.0", tvm_ffi="0.1.15", gpu="H100")


def test_arch_keys_match_flashinfer_workspace_names(fim):
    assert fim.arch_from_list("9.0a") == "90a"
    assert fim.arch_from_list("9.0") == "90a"  # FlashInfer adds the suffix on sm90
    assert fim.arch_from_list("9.0a 8.0") == "80_90a"
    assert fim.arch_from_list("10.0") == "100a"
    assert fim.arch_from_list("8.9") == "89"


def test_pack_cuts_parts_within_the_limit_and_writes_the_manifest(fim, cache, tmp_path):
    root, data = cache
    out = tmp_path / "out"
    m = fim.pack(out, cache=root, version=VERSION, arch="90a", max_file_mb=1, versions=VERSIONS)
    assert [x["name"] for x in m["modules"]] == sorted(data)  # the failed, empty and truncated builds are left out
    assert m["flashinfer_version"] == VERSION and m["cuda_arch"] == "90a" and m["torch_cuda"] == "13.0"
    sizes = {x["name"]: x["size"] for x in m["modules"]}
    assert sizes == {k: len(v) for k, v in data.items()}
    assert {x["name"]: x["build_s"] for x in m["modules"]}["norm"] == 32.5  # first compile start to link end
    packed = {x["name"]: x["packed"] for x in m["modules"]}
    assert packed["norm"] < 10_000 and packed["batch_prefill_fa3_head_dim_128"] > 2 * MIB
    parts = sorted(out.glob(fim.PART_PREFIX + "*"))
    assert [p.name for p in parts] == [x["file"] for x in m["parts"]]
    assert len(parts) >= 2 and all(p.stat().st_size <= MIB for p in parts)
    assert all(p.stat().st_size == MIB for p in parts[:-1])
    assert json.loads((out / fim.MANIFEST).read_text()) == m
    # only the .so of each module travels, under <name>/<name>.so
    import tarfile

    with fim.PartReader(parts) as r, tarfile.open(fileobj=r, mode="r|gz") as tar:
        names = [i.name for i in tar]
    assert names == [f"{n}/{n}.so" for n in sorted(data)]


def test_pack_selects_by_name_and_by_budget(fim, cache, tmp_path):
    root, _ = cache
    m = fim.pack(tmp_path / "a", cache=root, version=VERSION, arch="90a", only=["norm*"], versions=VERSIONS)
    assert [x["name"] for x in m["modules"]] == ["norm"]
    # 1 MiB of budget: norm fits (32.5 s saved, 0.3 MB of zeros packed to almost nothing); the 2 MiB module of
    # random bytes does not, and the manifest says it was left out
    m = fim.pack(tmp_path / "b", cache=root, version=VERSION, arch="90a", max_total_mb=1, versions=VERSIONS)
    assert [x["name"] for x in m["modules"]] == ["norm"]
    assert [x["name"] for x in m["left_out"]] == ["batch_prefill_fa3_head_dim_128"]


def test_pack_finds_version_and_arch_folders_or_asks(fim, cache, tmp_path, monkeypatch):
    root, data = cache
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(fim, "flashinfer_dir", lambda: None)
    m = fim.pack(tmp_path / "o", cache=root, versions=VERSIONS)
    assert (m["flashinfer_version"], m["cuda_arch"]) == (VERSION, "90a")
    (root / VERSION / "100a" / "cached_ops").mkdir(parents=True)
    with pytest.raises(fim.Refused, match="--arch"):
        fim.pack(tmp_path / "o", cache=root, versions=VERSIONS)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    assert fim.pack(tmp_path / "o", cache=root, versions=VERSIONS)["cuda_arch"] == "90a"
    with pytest.raises(fim.Refused, match="no built module"):
        fim.pack(tmp_path / "o", cache=root, arch="100a", versions=VERSIONS)


def test_install_puts_each_so_where_flashinfer_loads_aot_modules(fim, cache, tmp_path):
    root, data = cache
    out = tmp_path / "out"
    fim.pack(out, cache=root, version=VERSION, arch="90a", max_file_mb=1, versions=VERSIONS)
    aot = tmp_path / "flashinfer" / "data" / "aot"
    names = fim.install(out, aot_dir=aot, version=VERSION, arch="90a", versions=VERSIONS)
    assert sorted(names) == sorted(data)
    for name, blob in data.items():  # flashinfer/jit/env.py: FLASHINFER_AOT_DIR / name / f"{name}.so"
        assert (aot / name / f"{name}.so").read_bytes() == blob
    assert fim.installed(aot) == sorted((n, len(b)) for n, b in data.items())
    assert json.loads((aot / fim.INSTALLED_MANIFEST).read_text())["cuda_arch"] == "90a"
    assert not list(aot.rglob("*.part"))


@pytest.mark.parametrize(
    "version, arch, here, match",
    [
        ("0.7.1", "90a", VERSIONS, "FlashInfer here is 0.7.1"),
        (None, "90a", VERSIONS, "not found"),
        (VERSION, "100a", VERSIONS, "built for 90a"),
        (VERSION, "90a", dict(VERSIONS, torch_cuda="12.8"), "libcudart"),
    ],
)
def test_install_refuses_a_mismatch_and_touches_nothing(fim, cache, tmp_path, monkeypatch, version, arch, here, match):
    root, _ = cache
    monkeypatch.setattr(fim, "flashinfer_dir", lambda: None)  # version None: no FlashInfer here
    out = tmp_path / "out"
    fim.pack(out, cache=root, version=VERSION, arch="90a", versions=VERSIONS)
    aot = tmp_path / "aot"
    with pytest.raises(fim.Refused, match=match):
        fim.install(out, aot_dir=aot, version=version, arch=arch, versions=here)
    assert not aot.exists()
    # --force installs anyway
    assert fim.install(out, aot_dir=aot, version=version, arch=arch, versions=here, force=True)


def test_softer_differences_only_warn(fim):
    m = dict(flashinfer_version=VERSION, cuda_arch="90a", **VERSIONS)
    warnings = fim.check(m, VERSION, "90a", dict(VERSIONS, torch="2.12.0+cu130", tvm_ffi="0.1.16"))
    assert len(warnings) == 2 and "torch 2.12.0+cu130 here" in warnings[0]
    assert fim.check(m, VERSION, "90a", {}) == []  # nothing known here: nothing to compare


def test_install_refuses_a_damaged_or_missing_part(fim, cache, tmp_path):
    root, _ = cache
    out = tmp_path / "out"
    m = fim.pack(out, cache=root, version=VERSION, arch="90a", max_file_mb=1, versions=VERSIONS)
    last = out / m["parts"][-1]["file"]
    blob = bytearray(last.read_bytes())
    blob[10] ^= 0xFF
    last.write_bytes(bytes(blob))
    with pytest.raises(fim.Refused, match="differs from the manifest"):
        fim.install(out, aot_dir=tmp_path / "aot", version=VERSION, arch="90a", versions=VERSIONS)
    last.unlink()
    with pytest.raises(fim.Refused, match="missing"):
        fim.install(out, aot_dir=tmp_path / "aot", version=VERSION, arch="90a", versions=VERSIONS)
    with pytest.raises(fim.Refused, match="not a folder written"):
        fim.install(tmp_path, aot_dir=tmp_path / "aot", version=VERSION, arch="90a", versions=VERSIONS)


def test_command_line_round_trip_and_refusal(fim, cache, tmp_path, monkeypatch, capsys):
    root, data = cache
    pkg = tmp_path / "site" / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the tool must not import FlashInfer')\n")
    (pkg / "_build_meta.py").write_text(f'__version__ = "{VERSION}"\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "base"))
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(fim, "_versions", lambda: dict(VERSIONS))
    out = tmp_path / "out"
    assert fim.main(["pack", "--out", str(out)]) == 0
    assert fim.main(["install", str(out)]) == 0
    assert fim.installed(pkg / "data" / "aot") == sorted((n, len(b)) for n, b in data.items())
    capsys.readouterr()
    assert fim.main(["list"]) == 0
    text = capsys.readouterr().out
    assert f"FlashInfer: {VERSION}" in text and "loaded without building" in text and "2 modules" in text
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "10.0a")
    assert fim.main(["install", str(out)]) == 2
    assert "built for 90a" in capsys.readouterr().err
