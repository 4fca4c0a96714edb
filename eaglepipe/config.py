"""Configuration: validation against config/schema.yaml, with defaults filled in and errors naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator, validators

SCHEMA = Path(__file__).resolve().parent.parent / "config" / "schema.yaml"


class ConfigError(ValueError):
    pass


def _with_defaults(cls):
    check_properties = cls.VALIDATORS["properties"]

    def fill(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub and key not in instance:
                    instance[key] = copy.deepcopy(sub["default"])
        yield from check_properties(validator, properties, instance, schema)

    return validators.extend(cls, {"properties": fill})


def load(path) -> dict:
    """A YAML config file; ConfigError naming the file, line and column where it does not parse."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: byte {err.start} is not UTF-8; save the file as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}{where}: not valid YAML ({problem}); fix it there (indent with spaces, close every "
                          "bracket and quote)") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file holds keys at the top level, not a {type(data).__name__}")
    return data or {}


def validate(config: dict, schema_path=SCHEMA) -> dict:
    """Fill defaults into `config` in place and check it; raise ConfigError naming the first bad key."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = sorted(_with_defaults(Draft202012Validator)(schema).iter_errors(config), key=lambda e: list(e.path))
    if errors:
        lines = []
        for err in errors:
            key = ".".join(str(p) for p in err.absolute_path) or "(top level)"
            if err.validator == "additionalProperties":
                allowed = sorted(err.schema.get("properties", {}))
                prefix = "" if key == "(top level)" else key + "."
                for extra in sorted(set(err.instance) - set(allowed)):
                    lines.append(f"config key {prefix}{extra}: unknown key; allowed here: {', '.join(allowed)}")
            else:
                lines.append(f"config key {key}: {err.message}")
        raise ConfigError("invalid configuration (see config/README.md):\n  " + "\n  ".join(lines))
    return config



def scheduling_keys(schema_path=SCHEMA) -> dict[str, set[str]]:
    """Per section, the keys the schema marks `x-scheduling`: where and how fast a job runs, not what it writes."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    return {section: {key for key, sub in spec.get("properties", {}).items() if sub.get("x-scheduling")}
            for section, spec in schema["properties"].items()}


def output_settings(config: dict, section: str, schema_path=SCHEMA) -> dict:
    """The keys of `config[section]` that can change a job's outputs: a rule's `params`, so that a scheduling key
    (threads, GPUs, checkpoint interval) re-runs nothing. train.variants is left out: each variant's settings are
    its own job's (variant_settings)."""
    scheduling = scheduling_keys(schema_path)[section] | ({"variants"} if section == "train" else set())
    return {k: v for k, v in config[section].items() if k not in scheduling}


def variant_settings(config: dict, schema_path=SCHEMA) -> dict[str, dict]:
    """Per variant of train.variants, in the order of their names, its training job's settings: train's output settings
    with the variant's overrides, each checked against train's schema; ConfigError naming the variant and key."""
    schema = yaml.safe_load(Path(schema_path).read_text())["properties"]["train"]["properties"]
    scheduling = scheduling_keys(schema_path)["train"]
    base = output_settings(config, "train", schema_path)
    out = {}
    for name, overrides in sorted(config["train"].get("variants", {}).items()):
        for key, value in overrides.items():
            where = f"config key train.variants.{name}.{key}"
            if key in scheduling:
                raise ConfigError(f"{where}: a scheduling key applies to every variant; set train.{key} instead")
            if key not in base:
                allowed = ", ".join(sorted(base))
                raise ConfigError(f"{where}: not a train key a variant can set; allowed: {allowed}")
            errors = list(Draft202012Validator(schema[key]).iter_errors(value))
            if errors:
                raise ConfigError(f"{where}: {errors[0].message}")
        out[name] = {**base, **overrides}
    return out


def defaults(section: str, schema_path=SCHEMA) -> dict:
    """The schema's default of every key of `section`."""
    schema = yaml.safe_load(Path(schema_path).read_text())
    return {k: copy.deepcopy(v["default"]) for k, v in schema["properties"][section]["properties"].items()
            if "default" in v}
