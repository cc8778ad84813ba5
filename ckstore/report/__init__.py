"""Views over a whole repository for people: ``status`` and the HTML ``report``.

An operation layer above history/ and maintenance/ (it reads their figures) and remote/ (tracking
refs); below the Repo facade. Nothing here writes to the repository.
"""
