/* blucompiler generated reduction kernel {name}: domain {domain}, reduce {kind} over axes {axes} */
void {name}({params}) {{
  for (long long o = 0; o < {nout}LL; o++) {{
    {acc_t} acc = {init};
    for (long long r = 0; r < {nred}LL; r++) {{
{coords}{body}
      {combine}
    }}
    out0[o] = {finalize};
  }}
}}
