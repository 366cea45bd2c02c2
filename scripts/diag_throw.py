"""Which call path crashes when the op rejects bad input? Each variant runs in a subprocess."""
import argparse
import subprocess
import sys

argparse.ArgumentParser(description=__doc__).parse_args()

VARIANTS = {
    "op_cpu": "op(q, q, q)",
    "op_cuda": "op(q.cuda(), q.cuda(), q.cuda())",
    "below_autograd_cpu": "with torch._C._AutoDispatchBelowAutograd(): op(q, q, q)",
    "redispatch_cpu": "op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), q, q, q)",
    "torch_own_error": "torch.ops.aten.mm(q[0, 0], q[0, 0, :3])",
}
PRE = ("import torch, flash_attention_sm75\n"
       "op = torch.ops.flash_attention_sm75.fwd.default\n"
       "q = torch.randn(1, 4, 2, 32, dtype=torch.half)\n")
for name, stmt in VARIANTS.items():
    code = PRE + "try:\n    " + stmt.replace("\n", "\n    ") + "\nexcept Exception as e:\n    print(type(e).__name__, str(e)[:60])\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"{name:22s} rc={r.returncode} {r.stdout.strip()[:100]} {r.stderr.strip().splitlines()[-1] if r.returncode else ''}", flush=True)
