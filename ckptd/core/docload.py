"""JSON and YAML documents a person writes (a plan, the daemon's config, a cabling file,
NIC addresses), read so that a key given twice is an error: the parsers' last one
silently winning would hide the typo or hand edit of someone who meant two keys."""
from __future__ import annotations

import json
import re

from ckptd.errors import show


def strict_json(text: str):
    """json.loads, refusing a key given twice in one object (ValueError)."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys)


def _no_duplicate_keys(pairs: list) -> dict:
    """A JSON object, but a key given twice is an error: json's last one silently winning
    would hide a hand edit that meant to change the first (as the daemon's YAML does)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {show(k, 40)} given twice in one object")
        out[k] = v
    return out


def strict_yaml(text: str, decimal_only: bool = True):
    """yaml.safe_load, but a key given twice in one mapping is an error: YAML's last one
    silently winning would hide the typo of an operator who meant two different keys.
    decimal_only: an integer not written in decimal is an error too (the daemon's config);
    a cabling file takes hex (GRE protocol types, VLAN masks) as YAML reads it."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: keys given here override the merged ones, as YAML says
            key = loader.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise ValueError(f"key {str(key)[:60]!r} given twice (line {key_node.start_mark.line + 1})")
                seen.add(key)
            except TypeError:
                pass  # an unhashable key: construct_mapping says so
        return loader.construct_mapping(node, deep=deep)

    def integer(loader, node):
        # YAML 1.1 reads 010 as octal 8, 0x10 as 16 and 1:30 as 90 (base 60): an operator
        # who wrote keep_last: 010 meant ten. Only plain decimals are taken as written.
        text = loader.construct_scalar(node)
        if not re.fullmatch(r"[-+]?(0|[1-9][0-9_]*)", text):
            value = yaml.SafeLoader.construct_yaml_int(loader, node)
            raise ValueError(f"line {node.start_mark.line + 1}: {text[:40]} is read by YAML as {show(value)} "
                             "(octal, hex or base 60): write the number in decimal (or quote it where text is meant)")
        return yaml.SafeLoader.construct_yaml_int(loader, node)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    if decimal_only:
        Loader.add_constructor("tag:yaml.org,2002:int", integer)
    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)
