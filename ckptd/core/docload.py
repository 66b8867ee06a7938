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


# An integer YAML 1.1 reads as it looks: 010 is octal 8, 0x10 is 16 and 1:30 is 90 (base 60).
DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9_]*)")
MAX_DECIMAL_DIGITS = 4000  # below Python's int() limit (4300): past it the key's own range check never runs


def strict_yaml(text: str, decimal_only: bool = True, check_scalar=None):
    """yaml.safe_load, but a key given twice in one mapping is an error: YAML's last one
    silently winning would hide the typo of an operator who meant two different keys.
    decimal_only: an integer not written in decimal is an error too (the daemon's config);
    a cabling file takes hex (GRE protocol types, VLAN masks) as YAML reads it.
    check_scalar(path, line, written, value), where given, is called before the document is
    built for every unquoted scalar YAML 1.1 reads otherwise than it looks (yaml11_scalars),
    so that a caller who knows which keys hold text can refuse it naming the key."""
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
        if not DECIMAL.fullmatch(text):
            value = yaml.SafeLoader.construct_yaml_int(loader, node)
            raise ValueError(f"line {node.start_mark.line + 1}: {text[:40]} is read by YAML as {show(value)} "
                             "(octal, hex or base 60): write the number in decimal (or quote it where text is meant)")
        if len(text) > MAX_DECIMAL_DIGITS:  # int() stops at 4300 with Python's advice on raising the limit
            raise ValueError(f"line {node.start_mark.line + 1}: an integer of {len(text)} digits: no setting "
                             "takes one that long")
        return yaml.SafeLoader.construct_yaml_int(loader, node)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    if decimal_only:
        Loader.add_constructor("tag:yaml.org,2002:int", integer)
    if check_scalar is None:
        return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)
    loader = Loader(text)   # yaml.load's steps, with the node tree checked in between
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        for path, scalar in yaml11_scalars(node):
            value = yaml.SafeLoader.yaml_constructors[scalar.tag](loader, scalar)
            check_scalar(path, scalar.start_mark.line + 1, scalar.value, value)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def yaml11_scalars(root):
    """(path, node) of every unquoted scalar under a composed YAML node that YAML 1.1 reads
    otherwise than it looks: a boolean (yes, no, on, off), a float (1.10 is 1.1) or an
    integer not in decimal (DECIMAL). path: the keys and list indexes down to it, in
    document order. Each node is visited once: an alias bomb is a few nodes, shared.
    A decimal with digits grouped (1_0 is 10) is one too: as a number it means what it says,
    but where text is meant (a port named 1_0) the underscore is gone."""
    import yaml
    seen = set()
    stack = [((), root)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack += reversed([(path + (k.value if isinstance(k, yaml.ScalarNode) else "?",), v)
                               for k, v in node.value])
        elif isinstance(node, yaml.SequenceNode):
            stack += reversed([(path + (i,), v) for i, v in enumerate(node.value)])
        elif node.style is None and (node.tag in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")
                                     or node.tag == "tag:yaml.org,2002:int"
                                     and (not DECIMAL.fullmatch(node.value) or "_" in node.value)):
            yield path, node
