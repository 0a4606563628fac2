"""Reference solutions for 06_cudagraph.ipynb."""


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    top = min(max_num_seqs, 512)
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= top] + list(range(16, top + 1, 16))
    return sorted(set(sizes) | {top})


def pad_for_graph(slot_mapping: list[int], context_lens: list[int], sizes: list[int]):
    n = len(slot_mapping)
    bs = min(size for size in sizes if size >= n)  # the smallest graph that holds the batch
    padding = bs - n
    return bs, slot_mapping + [-1] * padding, context_lens + [0] * padding  # store nothing, attend to nothing
