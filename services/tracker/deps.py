"""Request dependencies as Annotated aliases: the store and the run name."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from spopp.settings.fields import Id

from .store import Store


def get_store(request: Request) -> Store:
    return request.app.state.store


StoreDep = Annotated[Store, Depends(get_store)]
RunName = Annotated[Id, Path(description="run name")]
