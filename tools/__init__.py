"""The user-side tools, beside the three processes: the ``storyjobs``
command (migrations, keys, operators' views), its HTTP client
(``storyjobs generate``) and ``make run``'s development runner."""
