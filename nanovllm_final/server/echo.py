"""Scoring on /v1/completions: `echo` (the prompt's text before the completion's, and with
`logprobs` the prompt's logprobs joined to the completion's in OpenAI's legacy shape, the
first token's null) and vLLM's `prompt_logprobs` field. With echo, max_tokens 0 scores the
prompt only: the engine generates one token, which the response leaves out.

This is what lm-evaluation-harness sends for loglikelihood (multiple-choice) tasks:
{"prompt": context + continuation, "max_tokens": 1, "logprobs": 1, "echo": true}; it sums
token_logprobs over the continuation and compares each with the best of its top_logprobs."""

from .protocol import CompletionRequest


def wants_scores(req) -> bool:
    """Does this completion request need the prompt's text or logprobs in its response?"""
    return isinstance(req, CompletionRequest) and (req.echo or req.prompt_logprobs is not None)


def prompt_entries(prompt: list[int], scored: list | None) -> list[dict]:
    """The prompt's logprob entries as the engine gives a completion's, the first with none."""
    return [{"token_id": prompt[0], "logprob": None, "top_logprobs": None}] + (scored or [None])[1:]


def vllm_prompt_logprobs(server, prompt: list[int], scored: list | None) -> list[dict | None]:
    """vLLM's shape: per position None (the first) or {token id: {"logprob", "decoded_token"}},
    the prompt's token and the top k."""
    out: list[dict | None] = [None]
    for entry in (scored or [None])[1:]:
        chosen = {entry["token_id"]: entry["logprob"]} | entry["top_logprobs"]
        out.append(
            {
                str(t): {"logprob": server.finite(lp), "decoded_token": server.token_text(int(t))}
                for t, lp in chosen.items()
            }
        )
    return out


def echo_choices(server, req: CompletionRequest, reply) -> list[dict]:
    """The choices of a finished non-streamed request; a score-only one counts no completion tokens."""
    handle, choices = reply.handle, []
    texts = req.prompts()
    for i in range(len(reply.text)):
        p = i // handle.n
        prompt, scored = handle.prompts[p], handle.prompt_logprobs[p]
        if req.score_only:
            reply.num_tokens[i] = 0  # the one token generated to run the prompt is not the client's
        text, generated = (
            ("", []) if req.score_only else ("".join(reply.text[i]), reply.logprobs[i])
        )
        logprobs = None
        if req.echo:
            prompt_text = (
                texts[p] if isinstance(texts[p], str) else server.client.tokenizer.decode(prompt)
            )
            text = prompt_text + text
            if req.logprobs is not None:
                logprobs = server.completion_logprobs(prompt_entries(prompt, scored) + generated)
        elif req.logprobs is not None:
            logprobs = server.completion_logprobs(generated)
        reason = "length" if req.score_only else reply.finish_reason[i]
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(server, prompt, scored)
        choices.append(choice)
    return choices
