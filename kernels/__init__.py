"""minillm's Triton kernels, installed as `minillm.kernels`.

One topic per file, each beside the plain-PyTorch reference it is tested against (on CPU under
TRITON_INTERPRET=1, natively on a GPU). The first kernels arrive with chapter 04 (FlashAttention).
"""
