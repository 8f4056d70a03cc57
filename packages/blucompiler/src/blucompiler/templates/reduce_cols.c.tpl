/* blucompiler: serial C emulation of the CUDA column reduction {name} (same per-thread code, same
   combination order), used by the tests to check its index arithmetic on the CPU */
void {name}({params}) {{
  static {acc_t} part[{splits}][{nout}];
  for (long long by = 0; by < {splits}; by++) {{
    for (long long bx = 0; bx < ({nout}LL + 31) / 32; bx++) {{
      {acc_t} sm[8][32];
      for (int ty = 0; ty < 8; ty++) {{
        for (int tx = 0; tx < 32; tx++) {{
          const long long o = bx * 32 + tx;
          const long long r0 = by * {chunk}LL;
          const long long r1 = (r0 + {chunk}LL < {nred}LL) ? r0 + {chunk}LL : {nred}LL;
          {acc_t} acc = {init};
          if (o < {nout}LL) {{
            for (long long r = r0 + ty; r < r1; r += 8) {{
{coords}{body}
              {combine}
            }}
          }}
          sm[ty][tx] = acc;
        }}
      }}
      for (int tx = 0; tx < 32; tx++) {{
        const long long o = bx * 32 + tx;
        if (o >= {nout}LL) continue;
        {acc_t} acc = sm[0][tx];
        for (int k = 1; k < 8; k++) {{
          {acc_t} other = sm[k][tx];
          {combine_other}
        }}
        part[by][o] = acc;
      }}
    }}
  }}
  for (long long o = 0; o < {nout}LL; o++) {{
    {acc_t} acc = part[0][o];
    for (int s = 1; s < {splits}; s++) {{
      {acc_t} other = part[s][o];
      {combine_other}
    }}
    out0[o] = {finalize};
  }}
}}
