"""memviz's first example: which line of this script holds the GPU memory?

Run it with:

    python -m memviz run examples/basic.py

It allocates CUDA memory with PyTorch in three clearly named functions, and the
report memviz prints at the end lists each line with what it held at the peak:

    load_weights()       one 256 MiB tensor, kept to the end
    make_activations()   four 32 MiB tensors made in a loop, kept to the end
    scratch_space()      one 512 MiB temporary, freed again: it makes the peak

Without PyTorch or without a CUDA GPU the script says so and skips the GPU
part; the report then explains that GPU capture needs an NVIDIA GPU, and
memviz follows it with the report of a run of this script recorded on a GPU
(the sample shipped in memviz/data, labelled with its machine and date).
"""

MiB = 1 << 20

# Asks `memviz run` to show its recorded sample report (see above) after this
# run's own when GPU capture is off here.
MEMVIZ_SAMPLE_WITHOUT_GPU = True


def load_weights(torch):
    """One big allocation, like loading a model's weights."""
    return torch.empty(256 * MiB // 4, dtype=torch.float32, device="cuda")


def make_activations(torch, steps=4):
    """Several allocations from one line, like a forward pass storing activations."""
    activations = []
    for _ in range(steps):
        activations.append(torch.ones(32 * MiB // 4, dtype=torch.float32, device="cuda"))
    return activations


def scratch_space(torch):
    """A large temporary, freed before the script ends."""
    scratch = torch.zeros(512 * MiB // 4, dtype=torch.float32, device="cuda")
    total = scratch.sum().item()
    del scratch
    # PyTorch keeps freed blocks in its cache; give them back to the driver so
    # that the report's "current" drops while its "peak" still shows this line.
    torch.cuda.empty_cache()
    return total


def cuda_torch():
    """(torch, None) when PyTorch can use a CUDA GPU, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed (pip install torch)"
    if not torch.cuda.is_available():
        return None, f"PyTorch {torch.__version__} found no usable CUDA GPU"
    return torch, None


def main():
    torch, why_not = cuda_torch()
    if torch is None:
        print(f"basic.py: skipped the GPU part: {why_not}.")
        return
    weights = load_weights(torch)
    activations = make_activations(torch)
    scratch_space(torch)
    torch.cuda.synchronize()
    held = weights.nbytes + sum(a.nbytes for a in activations)
    print(f"basic.py: holding {held // MiB} MiB on {torch.cuda.get_device_name()}.")


if __name__ == "__main__":
    main()
