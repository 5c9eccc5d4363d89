"""Typed configs, the one home of every default (``schema``), and the command-line check (``command_line``).

``from agl.config import GRPOConfig, typed`` is the way in: this package re-exports both modules' names.
"""
from agl.config.command_line import check_command_line, compose_checked, extra_keys
from agl.config.schema import (
    ALGO_SCHEMAS,
    DEFAULT_PROMPTS,
    NO_API_KEY,
    SCHEMA_NAMES,
    SCHEMAS,
    Config,
    CustomConfig,
    EngineConfig,
    EvalConfig,
    ExportConfig,
    GRPOConfig,
    InfoConfig,
    LoraConfig,
    ModelConfig,
    PromptSearchConfig,
    RunnerConfig,
    RunnerJobConfig,
    ServeConfig,
    ServerConfig,
    SFTConfig,
    TaskConfig,
    TinyConfig,
    client_api_key,
    config_record,
    plain,
    register_configs,
    to_typed,
    typed,
    with_schema,
)

__all__ = [
    "ALGO_SCHEMAS", "DEFAULT_PROMPTS", "NO_API_KEY", "SCHEMA_NAMES", "SCHEMAS", "Config", "CustomConfig", "EngineConfig",
    "EvalConfig", "ExportConfig", "GRPOConfig", "InfoConfig", "LoraConfig", "ModelConfig", "PromptSearchConfig",
    "RunnerConfig", "RunnerJobConfig", "ServeConfig", "ServerConfig", "SFTConfig", "TaskConfig", "TinyConfig",
    "check_command_line", "client_api_key", "compose_checked", "config_record", "plain", "to_typed", "extra_keys", "register_configs", "typed", "with_schema",
]
