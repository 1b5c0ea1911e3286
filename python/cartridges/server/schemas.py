"""What the resources' schema modules share: list objects (file_schemas, chat_schemas,
serving_schemas and datablock_schemas hold each resource's bodies)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

ListT = TypeVar("ListT", bound=BaseModel)


def list_object(cls: type[ListT], data: list[Any], has_more: bool) -> ListT:
    """A list object (`FileList`, `DatablockList`) for one page of entries with an `id`."""
    return cls(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
               has_more=has_more)
