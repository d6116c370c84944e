"""beta_1.2 and its control arms. `build_model(config)` returns the arm `config.arch` selects."""

from megabeta.model.beta12 import Beta12Transformer
from megabeta.model.config import (ConfigError, ModelConfig, count_parameters, get_preset,
                                   preset_names, resolve_fair_config)
from megabeta.model.execution import ExecutionConfig
from megabeta.model.transformer import DecoderLM, LoopedTransformer, StandardTransformer

_ARMS = {"beta12": Beta12Transformer, "standard": StandardTransformer,
         "looped": LoopedTransformer}


def build_model(config: ModelConfig, execution: ExecutionConfig | None = None) -> DecoderLM:
    """The model arm `config.arch` selects, initialised (see `DecoderLM.init_weights`), running
    as `execution` says (default: `ExecutionConfig()`)."""
    config.validate()
    if execution is not None:
        execution.validate()
    return _ARMS[config.arch](config, execution)


__all__ = ["ModelConfig", "ExecutionConfig", "ConfigError", "build_model", "get_preset", "preset_names",
           "count_parameters", "resolve_fair_config", "Beta12Transformer", "StandardTransformer",
           "LoopedTransformer", "DecoderLM"]
