"""transformers as the reference for the server tests: a checkpoint's greedy continuation, as text, of our
template's rendering of a conversation (thinking off), n tokens exactly."""
from __future__ import annotations

from typing import Callable


def greedy_answer(hf_dir: str) -> Callable[[list[dict], int], str]:
    import torch
    from transformers import AutoModelForImageTextToText

    from appliance.engine.chat_template import ChatTemplate
    from appliance.engine.tokenizer import Tokenizer

    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tok, template = Tokenizer.from_dir(hf_dir), ChatTemplate.from_dir(hf_dir)

    def answer(messages: list[dict], n: int) -> str:
        ids = tok.encode(template.render(messages, add_generation_prompt=True, enable_thinking=False))
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return tok.decode(out[0, len(ids):].tolist())
    return answer
