"""The pages' forms, every one with a CSRF token tied to the visitor's session (WTForms SessionCSRF)."""

from __future__ import annotations

import datetime
import math

from wtforms import Form, PasswordField, SelectField, StringField
from wtforms.csrf.session import SessionCSRF
from wtforms.fields.choices import SelectChoice
from wtforms.validators import DataRequired, EqualTo, Length, ValidationError

from llmgw.people.accounts import MIN_PASSWORD


class PageForm(Form):
    class Meta:
        csrf = True
        csrf_class = SessionCSRF
        csrf_time_limit = datetime.timedelta(hours=12)


def make(form_class, formdata, secret: bytes, session):
    """FORM_CLASS bound to FORMDATA (None for an empty form), checked against this session's token."""
    return form_class(formdata, meta={"csrf_secret": secret, "csrf_context": session})


class SignInForm(PageForm):
    email = StringField("Email", [DataRequired(), Length(max=320)])
    password = PasswordField("Password", [DataRequired()])


class SignUpForm(PageForm):
    email = StringField("Email", [DataRequired(), Length(max=320)])
    password = PasswordField("Password", [DataRequired(), Length(min=MIN_PASSWORD)])
    repeat = PasswordField("Password again", [EqualTo("password", "The two passwords differ.")])


class PasswordForm(PageForm):
    current = PasswordField("Current password", [DataRequired()])
    password = PasswordField("New password", [DataRequired(), Length(min=MIN_PASSWORD)])
    repeat = PasswordField("New password again", [EqualTo("password", "The two passwords differ.")])


class KeyForm(PageForm):
    name = StringField("Name", [DataRequired(), Length(max=100)],
                       description="What will use it: an editor, a script, a notebook.")
    # Choices are the person's projects, set per request; "personal" spends against them alone.
    spends = SelectField("Spends against", choices=[SelectChoice("personal", "Personal")], default="personal",
                         description="One of your projects, or Personal: your own use, within your own limits.")
    models = StringField("Only these models", [Length(max=2000)],
                         description="Optional: model names separated by commas. Empty: every model you may use.")
    band = SelectField("When the cluster is busy", choices=[SelectChoice("", "as your projects allow"),
                                                             SelectChoice("low", "let others go first (batch work)")],
                       default="")
    expires = SelectField("Expires", choices=[SelectChoice("30d", "in 30 days"), SelectChoice("90d", "in 90 days"),
                                              SelectChoice("", "never")], default="90d")


class ActionForm(PageForm):
    """A button that changes something (sign out, revoke): only a token."""


class Number:
    """A field's text as a number from LOW to HIGH (whole with WHOLE), else MESSAGE: the form says one sentence
    where int() and float() took "1_000", "nan" and "1e400", and raised on 5,000 digits."""

    def __init__(self, low: float, high: float, message: str, whole: bool = False):
        self.low, self.high, self.message, self.whole = low, high, message, whole

    def __call__(self, form, field) -> None:
        text = (field.data or "").strip()
        allowed = "0123456789" if self.whole else "0123456789."
        # Length first: a number within the bounds has few digits, and int() of thousands is slow, then refused.
        if not text or len(text) > 20 or any(c not in allowed for c in text) or text.count(".") > 1 or text == ".":
            raise ValidationError(self.message)
        value = int(text) if self.whole else float(text)
        if not (math.isfinite(value) and self.low <= value <= self.high):
            raise ValidationError(self.message)


ENGINES = ("llamacpp", "vllm", "sglang")
# What each of the serve form's run modes asks of the catalog.
RUN_MODES = {"always": {"min": 1, "max": 1}, "on_demand": {"min": 0, "max": 1}, "stopped": {"min": 0, "max": 0}}
LARGEST_CONTEXT = 2**31 - 1  # the catalog's bound (llmgw/control/catalog.py): gateways hold it in every snapshot
LARGEST_MEMORY_GB = 100_000


class ServeForm(PageForm):
    """The mirror page's "serve this": a file of the mirror into the catalog, bounded as the catalog is."""
    name = StringField("Name", [DataRequired("Give the model a name."),
                                Length(max=128, message="The name is at most 128 characters.")])
    source = StringField("Source", [DataRequired("Give the model's source."),
                                    Length(max=2000, message="The source is at most 2,000 characters.")])
    engine = SelectField("Engine", choices=ENGINES, validate_choice=False,
                         validators=[lambda form, field: _one_of(field, ENGINES, "The engine")])
    memory = StringField("Memory it needs (GiB)", [Number(0, LARGEST_MEMORY_GB, "The memory is a number of GiB from 0 "
                                                                             f"to {LARGEST_MEMORY_GB:,}.")])
    max_context = StringField("Context (tokens)", [Number(1, LARGEST_CONTEXT, "The context is a whole number of "
                                                                             f"tokens from 1 to {LARGEST_CONTEXT:,}.",
                                                          whole=True)])
    mode = SelectField("Runs", choices=list(RUN_MODES), validate_choice=False,
                       validators=[lambda form, field: _one_of(field, RUN_MODES, "The run mode")])


def _one_of(field, choices, what: str) -> None:
    if field.data not in choices:
        raise ValidationError(f"{what} is one of {', '.join(choices)}.")
