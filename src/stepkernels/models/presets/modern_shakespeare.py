"""The Shakespeare preset's model with a modern block (chapter 14's layers, as in Llama):
RMSNorm, rotary position embeddings, a SwiGLU MLP, grouped-query attention and no biases.
The same size and recipe as ``shakespeare``, so its tokens/s and loss curve compare with
GPT-2's block directly."""

# The shape of the shakespeare preset: 6 blocks of width 384, heads of 64, 256 characters.
n_layer = 6
n_head = 6
n_embd = 384
block_size = 256
dropout = 0.2  # as the shakespeare preset: the plays are small for 9.5M parameters

# The block. SwiGLU's inner width is 8C/3 = 1,024: its three matrices hold as many weights
# as GELU's two of 4C. Two k and v heads, each shared by three query heads, shrink the qkv
# projection from 3C to 10/6 C outputs: about 9.5M parameters instead of 10.8M.
norm = "rms"
position = "rotary"  # no position embedding: q and k turned by the position's angle
mlp = "swiglu"
n_kv_head = 2
bias = False  # Llama has none; RMSNorm has none anyway

# The optimizer and bookkeeping: the shakespeare preset's (nanoGPT's) values.
batch_size = 64
max_steps = 5000
learning_rate = 1e-3
min_lr = 1e-4
warmup_steps = 100
beta2 = 0.99

eval_interval = 250
eval_batches = 20
log_interval = 50
out_dir = "runs/modern-shakespeare"
