"""GPT-2 small's shape (12 layers, 12 heads, 768 wide, a context of 1,024) on Shakespeare's
characters: about 85M parameters, to measure our kernels at GPT-2's widths. Not a better
Shakespeare model: 85M parameters overfit the plays' 4.6M characters within a few passes."""

n_layer = 12
n_head = 12  # heads of 64 values, as GPT-2
n_embd = 768
block_size = 1024
dropout = 0.0  # GPT-2's pretraining used none; evaluation shows when it overfits

# 16 x 1,024 = 16,384 tokens a step, as the Shakespeare preset, so tokens/s compare directly.
# The step's batch, over all GPUs: on 2 (torchrun), --batch-size 32 keeps 16 sequences a GPU.
batch_size = 16
max_steps = 2000
# GPT-2 small's learning rate and AdamW's usual beta2 for larger models (nanoGPT's
# train_gpt2 values); a warm-up of 10% of the run.
learning_rate = 6e-4
min_lr = 6e-5
warmup_steps = 200
beta2 = 0.95

eval_interval = 250
eval_batches = 20
log_interval = 50
out_dir = "runs/gpt2-small"
sample_tokens = 500
