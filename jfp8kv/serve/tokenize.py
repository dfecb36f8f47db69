"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the server's tokenizer over HTTP.

Request and response shapes are vLLM's, so clients written for it work unchanged; in
particular lm-evaluation-harness's ``tokenizer_backend=remote`` (``local-completions``,
``local-chat-completions``) tokenizes through these routes, and a user of the default GGUF
model needs no Hugging Face tokenizer folder (docs/guide/lm-eval.md).

* ``POST /tokenize``: ``{"prompt": str, "add_special_tokens": true}`` (as /v1/completions
  encodes) or ``{"messages": [...], "add_generation_prompt": true}`` (as
  /v1/chat/completions renders and encodes). Answers ``{"count", "max_model_len", "tokens",
  "token_strs"}``; ``token_strs`` (each token's string) is null unless the request sends
  ``"return_token_strs": true`` (vLLM's default: false).
* ``POST /detokenize``: ``{"tokens": [int]}`` answers ``{"prompt": str}``.
* ``GET /tokenizer_info``: special tokens, the chat template and ``model_max_length``.

``python -m jfp8kv.serve.tokenize --out DIR [--model M]`` writes a model's tokenizer as a
Hugging Face folder (``AutoTokenizer.from_pretrained(DIR)``), for tools that want one.
"""

from __future__ import annotations

from typing import Any, Callable, Union

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from jfp8kv.serve.openai_serving import ApiError
from jfp8kv.serve.protocol import ChatMessage


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def _text(req: TokenizeChatRequest, tokenizer: Any, chat_prompt: Callable) -> str:
    """The chat prompt exactly as /v1/chat/completions renders it (its ``chat_prompt``)
    unless the request asks for another generation-prompt setting."""
    try:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    except ValueError as e:
        raise ApiError(400, str(e), "messages", "invalid_value") from None
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "continue_final_message needs add_generation_prompt: false",
                       "continue_final_message", "invalid_value")
    try:
        if req.add_generation_prompt:
            return chat_prompt(messages)
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False,
            continue_final_message=req.continue_final_message)
    except Exception as e:  # noqa: BLE001 - template errors are caused by the messages
        raise ApiError(400, f"chat template failed: {e}", "messages", "invalid_value") from None


def add_tokenize_routes(app: FastAPI, *, model: str, tokenizer: Any, chat_prompt: Callable,
                        max_model_len: int, vocab_size: int | None = None) -> None:
    """Register the three routes on ``app`` (whose handlers turn ``ApiError`` into OpenAI's
    error object). ``model``: the served name a request's optional ``model`` must equal."""

    def check_model(name: str | None) -> None:
        if name is not None and name != model:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                           f"{model!r}", "model", "model_not_found")

    @app.post("/tokenize")
    def tokenize(req: Union[TokenizeCompletionRequest, TokenizeChatRequest]):
        check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            text = _text(req, tokenizer, chat_prompt)
        else:
            text = req.prompt
        ids = list(tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        limit = vocab_size or len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < limit]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range [0, {limit})", "tokens",
                           "invalid_value")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.get("/tokenizer_info")
    def tokenizer_info():
        return {"tokenizer_class": type(tokenizer).__name__,
                "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
                "chat_template": getattr(tokenizer, "chat_template", None),
                "model_max_length": max_model_len}


def save_tokenizer(model: str | None, out: str) -> str:
    """Write ``model``'s tokenizer (default: the built-in default model's) to the folder
    ``out`` with ``save_pretrained``; returns ``out``. Loads the whole model: simple, and
    the model is small or cached by then."""
    from jfp8kv.models.loader import load_model

    load_model(model, "float32").tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m jfp8kv.serve.tokenize",
                                description="Write a model's tokenizer as a Hugging Face folder.")
    p.add_argument("--model", default=None, help="as the server's --model (default: its default)")
    p.add_argument("--out", required=True, help="folder to write (created if missing)")
    args = p.parse_args(argv)
    print(save_tokenizer(args.model, args.out))


if __name__ == "__main__":
    main()
