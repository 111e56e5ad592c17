"""The Triton kernels torch.compile writes for chapter 03's forward benchmark (GPU only).

torch.compile's layer-norm forward stays 1 to 6% ahead of ours on rows that fit one program
(fp16 N = 8,192 to 32,768, fp32 4,096 to 32,768; M = 4,096). This compiles
``torch.nn.functional.layer_norm`` for fp16 at N = 16,384 and fp32 at N = 8,192 and prints
the generated kernels with their launch settings, to compare with ours:

    TORCH_LOGS=output_code python lab/layer_norm_inductor_code.py
"""

import torch


def main():
    for dtype, n_cols in ((torch.float16, 16384), (torch.float32, 8192)):
        torch._dynamo.reset()
        x = torch.randn(4096, n_cols, device="cuda", dtype=dtype)
        w, b = torch.rand(n_cols, device="cuda", dtype=dtype), torch.randn(n_cols, device="cuda", dtype=dtype)
        compiled = torch.compile(torch.nn.functional.layer_norm)
        compiled(x, (n_cols,), w, b)
        torch.cuda.synchronize()
        print(f"== compiled for {dtype}, N = {n_cols}", flush=True)


if __name__ == "__main__":
    main()
