"""The offline report (`harness report`: saved runs as HTML, Markdown or JSON) and the run database (`harness db`)."""
