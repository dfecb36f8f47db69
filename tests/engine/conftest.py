from tests.models.conftest import tiny_hf_checkpoint, tiny_tokenizer_dir  # noqa: F401
