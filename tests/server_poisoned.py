"""`nanovllm serve` whose engine step raises once a prompt starting with POISON is running:
a stand-in for any fault inside a step. Run as a script, so that the engine process, which
multiprocessing spawns and which imports this main module again, gets the fault too."""

import pathlib
import sys

sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[1])
)  # this checkout's nanovllm_final

from nanovllm_final.engine import llm_engine  # noqa: E402

POISON = [7, 7, 7, 7]
_step = llm_engine.LLMEngine.step


def _poisoned_step(self, *args, **kwargs):
    if any(r.prompt_token_ids[: len(POISON)] == POISON for r in self.requests.values()):
        raise RuntimeError("injected fault in a step")
    return _step(self, *args, **kwargs)


llm_engine.LLMEngine.step = _poisoned_step

if __name__ == "__main__":
    from nanovllm_final.server.cli import main

    main()
