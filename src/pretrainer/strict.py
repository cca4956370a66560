"""The strict base of every typed section: an unknown key is an error (a typo like `warmup_step` must not pass
silently), assignments are validated, and each field's docstring is its reference. A leaf, so the model's own
section (`model/section.py`) and the recipe's sections share it without the model importing the recipe."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
