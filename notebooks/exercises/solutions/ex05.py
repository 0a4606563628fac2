"""Reference solutions for 05_chunked_prefill.ipynb."""


def plan_step(running: list[int], waiting: list[int], budget: int, max_num_seqs: int) -> list[int]:
    plan = []
    for left in running:  # running sequences first, in admission order
        if budget == 0:
            break
        plan.append(min(left, budget))
        budget -= plan[-1]
    num_running = len(running)
    for length in waiting:  # then admit waiting prompts while there is budget and a free seat
        if budget == 0 or num_running >= max_num_seqs:
            break
        plan.append(min(length, budget))
        budget -= plan[-1]
        num_running += 1
    return plan


def document_chunks(prompt_len: int, num_decoding: int, budget: int) -> list[int]:
    chunks, left = [], prompt_len
    while left:
        chunks.append(min(left, budget - num_decoding))  # the decode tokens are scheduled first
        left -= chunks[-1]
    return chunks
