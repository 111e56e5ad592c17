"""nanoGPT's shakespeare_char model and recipe: the defaults of train.Config, spelled out."""

# The model: about 10.7M parameters, small enough that one H100 trains it in about a minute,
# large enough that its layers' products are real work (K = 384 and 1,536).
n_layer = 6
n_head = 6
n_embd = 384
block_size = 256  # characters of context: a few lines of verse
dropout = 0.2  # a small model on 4.6M characters still overfits without it

# The optimizer: nanoGPT's values for this model. Batches of 64 x 256 = 16,384 tokens; 5,000
# steps are 82M tokens, 18 passes over the plays. A small model takes a high learning rate;
# beta2 = 0.99 because few tokens pass per step.
batch_size = 64
max_steps = 5000
learning_rate = 1e-3
min_lr = 1e-4  # learning_rate / 10, as Chinchilla's schedule
warmup_steps = 100
beta2 = 0.99

# Bookkeeping: 20 evaluations of 20 batches of each split, a line every 50 steps.
eval_interval = 250
eval_batches = 20
log_interval = 50
out_dir = "runs/shakespeare"
