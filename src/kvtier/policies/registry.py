"""Policies by name."""

from __future__ import annotations

from typing import Any

from .base import EvictionPolicy, PolicyError

_REGISTRY: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator: make a policy available by its `name`."""
    if not cls.name:
        raise PolicyError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise PolicyError(f"policy name {cls.name!r} is already registered by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[EvictionPolicy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyError(f"unknown policy {name!r}; available: {', '.join(available())}") from None


def make_policy(name: str, **params: Any) -> EvictionPolicy:
    """Build a policy by name; unknown parameters are an error naming them."""
    cls = policy_class(name)
    try:
        return cls(**params)
    except TypeError as exc:
        raise PolicyError(f"bad parameters for policy {name!r}: {exc}") from None
