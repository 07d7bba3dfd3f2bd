"""The pages' answers when a page cannot be shown (400, 403, 404, 405, 500), and the site's icon.

Each is a page in the site's layout that says what happened and what to do next, instead of
Werkzeug's bare text. A path under `/v1` that reaches the pages (`/v1` itself: every real API path
goes to the proxy before Flask) is answered in OpenAI's error shape, which API clients parse.
A 500 names no cause: Flask has logged the exception with the request id the page shows.
"""

from __future__ import annotations

from flask import Blueprint, Response, current_app, make_response, render_template, request, send_from_directory
from werkzeug.exceptions import HTTPException

from llmgw.gateway import errors, requestid

# What each page says; a view that aborts with a description of its own (400's "The form expired") says that.
PAGES = {
    400: ("That did not work", "The request was not one this page can take. Go back and try again."),
    403: ("Not for this account", "The account you signed in with may not open this page. Sign in with "
                                  "another, or ask an administrator for access."),
    404: ("No such page", "Nothing is here. The menu above has every page there is."),
    405: ("Not like that", "This page cannot be used that way. Go back and use its buttons and links."),
    500: ("Something went wrong", "This page failed on our side, and the failure is in the gateway's log. "
                                  "Try again; if it keeps failing, tell an operator the request id below."),
}
CODES = {400: "bad_request", 403: "forbidden", 404: "not_found", 405: "method_not_allowed", 500: "internal_error"}


bp = Blueprint("errorpages", __name__)


@bp.get("/favicon.ico")
def favicon():
    # Browsers ask for /favicon.ico whatever the page says; every page was a 404 in the log once.
    return send_from_directory(current_app.static_folder, "favicon.svg", mimetype="image/svg+xml", max_age=86400)


def _answer(e: HTTPException) -> Response:
    status = e.code if e.code in PAGES else 500
    title, text = PAGES[status]
    described = e.description if e.description != type(e).description else None
    if request.path == "/v1" or request.path.startswith("/v1/"):
        error = errors.ApiError(status, described or text, CODES[status])
        answer = Response(error.body(), status, mimetype="application/json")
    else:
        answer = make_response(render_template("message.html", title=title, text=described or text,
                                               request_id=requestid.current.get() if status == 500 else None), status)
    if getattr(e, "valid_methods", None):  # a 405 says what the page does take
        answer.headers["Allow"] = ", ".join(e.valid_methods)
    return answer


for _status in PAGES:  # every page's, not only this blueprint's: the app's own handlers
    bp.app_errorhandler(_status)(_answer)
