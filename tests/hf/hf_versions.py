"""What the tests read from ``transformers`` objects whose names changed across the supported
versions (5.17 to the newest), so one test runs on all of them."""


def cache_of(output):
    """The generation state of an output: ``output.cache`` in recent ``transformers``,
    ``output.past_key_values`` before (the models fill whichever field the version has)."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def activation_checkpointing(model) -> bool:
    """``model.is_activation_checkpointing`` (recent ``transformers``), ``is_gradient_checkpointing`` before."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def cache_arg(cache) -> dict:
    """A prompt cache for ``generate``, under the name the installed ``transformers`` gives it:
    ``cache=`` in recent versions, ``past_key_values=`` before (5.17 leaves ``cache=`` to the model)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return {"cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values": cache}
