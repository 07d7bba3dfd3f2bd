"""The pages' forms, every one with a CSRF token tied to the visitor's session (WTForms SessionCSRF)."""

from __future__ import annotations

import datetime

from wtforms import Form, PasswordField, SelectField, StringField
from wtforms.csrf.session import SessionCSRF
from wtforms.fields.choices import SelectChoice
from wtforms.validators import DataRequired, EqualTo, Length

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
