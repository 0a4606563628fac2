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
    if budget <= num_decoding:
        raise ValueError(f"the {num_decoding} decoding sequences take the whole budget of {budget}: the prompt never starts")
    chunks, left = [], prompt_len
    while left:
        chunks.append(min(left, budget - num_decoding))  # the decode tokens are scheduled first
        left -= chunks[-1]
    return chunks


def schedule(self) -> list:
    """One step of the token-budget scheduler, bound to the stage's Scheduler as `self`."""
    self.num_preemptions = 0
    budget, scheduled, still_running = self.max_num_batched_tokens, [], []
    while self.running:  # running sequences first, in admission order
        seq = self.running.popleft()
        if budget == 0:
            still_running.append(seq)  # no room this step: it keeps its blocks and waits
            continue
        while not self.block_manager.can_append(seq):  # make room: preempt the most recently admitted
            if self.running:
                self.preempt(self.running.pop())
            else:
                self.preempt(seq)
                break
        else:
            self.block_manager.may_append(seq)
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)  # a decode token or a chunk
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            still_running.append(seq)
    self.running.extend(still_running)
    if self.num_preemptions:
        return scheduled  # a step that had to free memory admits no one
    while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
        seq = self.waiting[0]
        if not self.block_manager.can_allocate(seq):
            break
        self.block_manager.allocate(seq)
        seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)  # the last one may get a chunk
        budget -= seq.num_scheduled_tokens
        seq.status = type(seq.status).RUNNING
        self.running.append(self.waiting.popleft())
        scheduled.append(seq)
    return scheduled
