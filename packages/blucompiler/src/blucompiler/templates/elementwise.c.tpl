/* blucompiler generated elementwise kernel {name}: domain {domain} */
void {name}({params}) {{
  for (long long i = 0; i < {numel}LL; i++) {{
{coords}{body}
  }}
}}
