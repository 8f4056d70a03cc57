"""Launch-argument check without a GPU: runs tests/kernel_checks.py's checks on the repository's fake CUDA device
(testing/fake_cuda/: kernels only recorded) and compares every launch's argument count and scalar types with the
kernel's C signature (from ``nvcc -E``). Usage (repo root): python packages/blutensor/dev/launch_argcheck.py
"""

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KDIR = HERE.parent / "src" / "blutensor" / "backends" / "cupy" / "kernels"
sys.path[:0] = [str(HERE.parents[2] / "testing"), str(HERE.parent / "src"), str(HERE), str(HERE.parent / "tests")]
import fake_cuda  # noqa: E402

cupy = fake_cuda.make_cupy()
sys.modules.update(fake_cuda.modules(cupy))

sigs = {}
for f in sorted(KDIR.glob("*.cu")):
    src = subprocess.run(["nvcc", "-E", "-x", "cu", "-arch=sm_90", str(f)], capture_output=True, text=True).stdout
    entry = (r'extern "C" (?:__global__|__attribute__\(\(global\)\)) void\s+'
             r"(?:__attribute__\(\([^;{]*?\)\)\s*|__launch_bounds__\([^)]*\)\s*)*(blu_\w+)\s*\(([^)]*)\)")
    for m in re.finditer(entry, src):
        sigs[m.group(1)] = [a.strip() for a in m.group(2).split(",") if a.strip()]
import kernel_checks as gc  # noqa: E402

for fn in (
    gc.check_layer_norm,
    gc.check_gelu,
    gc.check_cross_entropy,
    gc.check_embedding,
    gc.check_adamw,
    gc.check_grad_norm,
    gc.check_sdpa_f32,
    gc.check_sdpa_bf16,
    gc.check_sdpa_tf32,
    gc.check_plugins,
    gc.check_layer_norm_paths,
    gc.check_gelu_paths,
    gc.check_cross_entropy_paths_f32,
    gc.check_cross_entropy_paths_bf16,
    gc.check_grad_norm_paths,
):
    fn()

want = {"long long": "int64", "int": "int32", "float": "float32", "double": "float64"}
bad = 0
seen = set()
for name, _grid, _block, nargs, _smem, types in cupy.device.launches:
    seen.add(name)
    params = sigs[name]
    if len(params) != nargs:
        print("BAD count", name)
        bad += 1
        continue
    for prm, ty in zip(params, types):
        base = prm.rsplit(" ", 1)[0].replace("const ", "").strip()
        if "*" in prm:
            ok = ty in ("ptr", "uint64")
        else:
            ok = want.get(base) == ty
        if not ok:
            bad += 1
            print("BAD type", name, prm, ty)
print("never launched:", sorted(set(sigs) - seen), "bad", bad)
sys.exit(1 if bad or not cupy.device.launches else 0)
