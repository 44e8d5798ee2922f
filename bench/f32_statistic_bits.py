import numpy as np, ml_dtypes
rng=np.random.default_rng(0)
n,d=4000,4096
x=rng.standard_normal((n,d)).astype(ml_dtypes.bfloat16).astype(np.float32)
eps=1e-6
# double statistic: exact squares, sum in double, rstd in double, rounded once to float32
ss=(x.astype(np.float64)**2).sum(1)
r64=(1/np.sqrt(ss/d+eps)).astype(np.float32)
# float32 statistic (warp-tree-ish pairwise sum in float32), rstd in float32 (rsqrt-like: 1/sqrt)
sq=(x*x).astype(np.float32)
s32=sq.reshape(n,-1,32).sum(2,dtype=np.float32).sum(1,dtype=np.float32)
r32=(np.float32(1)/np.sqrt(s32/np.float32(d)+np.float32(eps))).astype(np.float32)
# float32 sum but epilogue in double
r32d=(1/np.sqrt(s32.astype(np.float64)/d+eps)).astype(np.float32)
# exact sum in double but epilogue in float32
r3=(np.float32(1)/np.sqrt(ss.astype(np.float32)/np.float32(d)+np.float32(eps)))
print("f32 sum+f32 epilogue differs:", (r32!=r64).mean(), " f32 sum + f64 epilogue:", (r32d!=r64).mean(), " exact sum + f32 epilogue:", (r3!=r64).mean())
