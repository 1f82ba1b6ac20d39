"""Models for the tests that stand in for other projects' code: each says which interface it keeps."""
