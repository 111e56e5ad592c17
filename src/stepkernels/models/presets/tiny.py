"""A model small enough for a CPU: the whole path (data, our kernels under Triton's
interpreter, evaluation, checkpoint, sample) in a few minutes. It checks that things run,
and learns little more than which characters are common."""

# Two blocks of width 32 on batches of 4 x 16 characters: the interpreter runs every program
# of every kernel in Python, so a step costs what its launches and tiles cost, not its FLOPs
# (about 5 s of CPU time a step).
n_layer = 2
n_head = 2
n_embd = 32
block_size = 16
batch_size = 4
# Chapter 06's dropout draws its random numbers in Python under the interpreter: four times
# the step's cost. A model this small does not overfit in 30 steps anyway.
dropout = 0.0

# A tiny model takes a large learning rate; 30 steps move the validation loss from 4.4 (84
# characters equally likely) to about 3.3.
max_steps = 30
learning_rate = 1e-2
min_lr = 1e-3
warmup_steps = 4

eval_interval = 15
eval_batches = 2
log_interval = 5
out_dir = "runs/tiny"
sample_tokens = 30  # each character is one forward pass of the model
