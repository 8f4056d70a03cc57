"""Why does CuPy not find blublas's kernels? Compile each .cu as blublas does and list the entry names."""
import re
import sys

import cupy

sys.path.insert(0, "packages/blublas/src")
from blublas.loader import _source  # noqa: E402

for f in ("gemm_simt_f32.cu", "gemm_mma_tf32.cu"):
    src = _source(f)
    want = re.findall(r"blu_gemm_\w+", src)[:3]
    for opts in (("-std=c++17", "-arch=sm_90"), ("-std=c++17",)):
        try:
            ptx = cupy.cuda.compiler.compile_using_nvrtc(src, opts)
            ents = re.findall(r"\.entry\s+(\S+)\(", ptx.decode() if isinstance(ptx, bytes) else str(ptx))
            print(f, opts, "ptx entries:", len(ents), ents[:3])
        except Exception as e:  # noqa: BLE001
            print(f, opts, "compile_using_nvrtc error:", type(e).__name__, str(e)[:300])
        try:
            m = cupy.RawModule(code=src, options=opts)
            pass
            for n in re.findall(r"BLU_\w+_CONFIG\((\w+)", src)[:2]:
                for name in (f"blu_gemm_simt_{n}_nn", f"blu_gemm_tf32_{n}_nn"):
                    try:
                        m.get_function(name)
                        print("  found", name)
                    except Exception as e:  # noqa: BLE001
                        print("  missing", name, type(e).__name__)
        except Exception as e:  # noqa: BLE001
            print("RawModule error", type(e).__name__, str(e)[:300])
    print(f, "macros:", re.findall(r"#define (BLU_\w+)", src)[:6], "extern C:", src.count("extern \"C\""))
