"""OpenAI-compatible HTTP serving: ``build_app(engine, model_name)`` and ``redknot serve``."""

__all__ = ["build_app"]


def __getattr__(name):
    # The app pulls in torch, transformers and fastapi; the CLI parser must stay cheap to import.
    if name == "build_app":
        from .app import build_app
        return build_app
    raise AttributeError(f"module 'redknot.serve' has no attribute {name!r}")
