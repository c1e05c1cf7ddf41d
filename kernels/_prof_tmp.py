import sys; sys.path.insert(0, ".")
import torch, triton.testing as tt, torch.nn.functional as F
import path_attention as pa
B,H,T,D=8,32,4096,64
q,k,v=(torch.randn(B,H,T,D,device='cuda',dtype=torch.bfloat16,requires_grad=True) for _ in range(3))
w=F.normalize(torch.randn(B,H,T,D,device='cuda'),dim=-1).requires_grad_(True); beta=(2*torch.rand(B,H,T,device='cuda')).requires_grad_(True)
def pre():
    outs=pa.ut_blocks(q,k,w,beta,0.125,64)
    torch.autograd.backward(outs,[torch.ones_like(o) for o in outs])
print("ut_blocks fwd ms", tt.do_bench(lambda: pa.ut_blocks(q,k,w,beta,0.125,64)))
print("ut_blocks fwd+bwd ms", tt.do_bench(pre))
