"""``tensorturn dashboard``: a live web view of the pool and its runs (:mod:`.app` serves it,
:mod:`.view` says what it shows, ``page.html`` draws it)."""
