"""A tiny real Qwen3 checkpoint whose weights are set so that greedy decoding follows a script: each token's
successor is fixed (attention and MLP outputs are zero, so the last hidden state is the current token's
embedding, and the LM head row of its successor is that embedding). Real architecture, real tokenizer, real
chat template; it lets end-to-end tests see a model think and call a tool, which random weights never do.

Scripts (the token a prompt ends with picks the path):
- after "assistant\\n" (thinking on, the template's default): <think>Let me check</think> then a tool call
  <tool_call>{"name":"get_weather","arguments":{"city": "Paris"}}</tool_call> and <|im_end|>;
- after "</think>\\n\\n" (thinking off): " Sunny in Paris today." and <|im_end|>.
"""
from __future__ import annotations

import os
import shutil

from tests.support.tiny_models import FIXTURES, write_generation_config, write_tokenizer

CALL_TEXT = '{"name":"get_weather","arguments":{"city": "Paris"}}'
THINKING = "Let me check"
ANSWER = " Sunny in Paris today."
PATHS = {
    "\n": ["<think>", "Let", " me", " check", "</think>", "<tool_call>", '{"', "name", '":"', "get", "_weather",
           '","', "arguments", '":{"', "city", '":', ' "', "Paris", '"}}', "</tool_call>", "<|im_end|>"],
    "\n\n": [" Sunny", " in", " Paris", " today", ".", "<|im_end|>"],
}


def build_scripted_qwen3(out_dir: str, hidden: int = 64, seed: int = 7) -> str:
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    write_tokenizer(out_dir)
    tk = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))

    def tid(piece: str) -> int:
        ids = tk.encode(piece, add_special_tokens=False).ids
        assert len(ids) == 1, (piece, ids)
        return ids[0]

    successor: dict[int, int] = {}
    for start, script in PATHS.items():
        ids = [tid(start)] + [tid(p) for p in script]
        for a, b in zip(ids, ids[1:]):
            assert successor.setdefault(a, b) == b, f"token {a} has two successors"
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
                      max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        emb = torch.randn(cfg.vocab_size, hidden)
        model.model.embed_tokens.weight.copy_(emb)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()            # the residual stream stays the current token's embedding
        head = torch.zeros(cfg.vocab_size, hidden)
        for a, b in successor.items():
            head[b] += 4.0 * emb[a] / emb[a].norm()   # logit(b | a) = 4 * sqrt(hidden) = 32; others ~ +-10
        model.lm_head.weight.copy_(head)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    write_generation_config(out_dir)
    shutil.copyfile(os.path.join(FIXTURES, "qwen3", "chat_template.jinja"), os.path.join(out_dir, "chat_template.jinja"))
    return out_dir
