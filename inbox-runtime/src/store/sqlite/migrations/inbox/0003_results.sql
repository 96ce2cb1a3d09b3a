-- inbox-runtime: a small result stored with a claimed key (claim sessions: an HTTP response),
-- returned to later claims of the same key.
ALTER TABLE inbox_messages ADD COLUMN result BLOB;
