"""Compiles the CUDA kernels with NVRTC as the backend does at run time, for every head
dimension the GPU kernels take, so that a kernel that does not compile fails CI on a machine
with no GPU instead of a device run. NVRTC comes from the `nvidia-cuda-nvrtc` wheel that
torch installs (scripts/install-torch); the source files, their order and the defines are
read from kernels/src/cuda/mod.rs, as the backend builds them.

Usage: python scripts/check_cuda.py  (run by scripts/check-cuda).
       python scripts/check_cuda.py --regs PREFIX [-DNAME=VALUE ...]: compiles for sm_90 with
       HEAD_DIM=128 (or a -DHEAD_DIM given) and prints the registers and spills ptxas reports
       for every kernel whose name starts with PREFIX (e.g. kv43_partial), with the extra
       defines (e.g. -DK43_MIN_BLOCKS=10): what limits a kernel's occupancy, with no GPU."""

import ctypes
import glob
import os
import re
import site
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.path.join(ROOT, "kernels", "src", "cuda")


def nvrtc():
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    found = sorted(p for d in dirs for p in glob.glob(os.path.join(d, "nvidia", "**", "libnvrtc.so*"), recursive=True)
                   if "builtins" not in p and "alt" not in p)
    if not found:
        sys.exit("check-cuda: no libnvrtc in this Python's site-packages (install torch: scripts/install-torch)")
    # NVRTC opens its builtins library by name at compile time: load it first, globally.
    for b in glob.glob(os.path.join(os.path.dirname(found[-1]), "libnvrtc-builtins.so*")):
        if "alt" not in b:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(found[-1]), found[-1]


def source_and_defines():
    rs = open(os.path.join(CUDA, "mod.rs")).read()
    block = re.search(r"const SOURCE: &str = concat!\((.*?)\);", rs, re.S).group(1)
    files = re.findall(r'include_str!\("([^"]+)"\)', block)
    const = lambda name: int(re.search(rf"const {name}: usize = (\d+);", rs).group(1))
    src = "".join(open(os.path.join(CUDA, f)).read() for f in files)
    return src, files, {"MAX_GROUP": const("MAX_GROUP"), "RADIX_REGS": const("RADIX_REGS")}


def compile_one(lib, src, arch, head_dim, defines, extra=()):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"attnstore.cu", 0, None, None) != 0:
        return False, "nvrtcCreateProgram failed"
    opts = [f"--gpu-architecture={arch}".encode(), f"-DHEAD_DIM={head_dim}".encode(), b"--use_fast_math"]
    opts += [f"-D{k}={v}".encode() for k, v in defines.items()] + [e.encode() for e in extra]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace").strip()


def registers(lib, src, defines, prefix, extra):
    """Prints ptxas' registers and spills per kernel whose name starts with `prefix`."""
    head_dim = next((int(e.split("=")[1]) for e in extra if e.startswith("-DHEAD_DIM=")), 128)
    extra = [e for e in extra if not e.startswith("-DHEAD_DIM=")] + ["--ptxas-options=-v"]
    ok, log = compile_one(lib, src, "sm_90", head_dim, defines, extra)
    if not ok:
        sys.exit(f"check-cuda: does not compile\n{log}")
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m and m.group(1).startswith(prefix):
            info = " ".join(lines[i + 1:i + 4])
            used = re.search(r"Used (\d+) registers", info)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
            print(f"{m.group(1)}: {used.group(1) if used else '?'} registers, "
                  f"spills {spill.group(1) if spill else '?'} B stored / {spill.group(2) if spill else '?'} B loaded")


def main():
    lib, path = nvrtc()
    src, files, defines = source_and_defines()
    if len(sys.argv) > 2 and sys.argv[1] == "--regs":
        registers(lib, src, defines, sys.argv[2], sys.argv[3:])
        return
    # The backend's range (GpuBackend::new: multiples of 32 up to 256) on Ampere and Hopper.
    builds = [(arch, head_dim) for arch in ("compute_80", "compute_90") for head_dim in range(32, 257, 32)]
    failed = 0
    for arch, head_dim in builds:
        ok, log = compile_one(lib, src, arch, head_dim, defines)
        if not ok:
            failed += 1
            print(f"check-cuda: {arch}, HEAD_DIM={head_dim}: does not compile\n{log}")
        elif log:
            print(f"check-cuda: {arch}, HEAD_DIM={head_dim}: warnings\n{log}")
    print(f"check-cuda: {' + '.join(files)} with {os.path.basename(path)}: "
          f"{len(builds) - failed} of {len(builds)} (architecture, head dimension) builds compile")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
