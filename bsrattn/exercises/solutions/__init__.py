"""The shipped solutions, one file per exercise under the stub's name; CI grades them (``check --solutions``)."""
