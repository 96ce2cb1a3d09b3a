-- inbox-runtime: payloads over the dispatcher's size limit are kept cut to the limit, with
-- their real size (NULL: the payload is kept whole), under the reason `too_large`.
ALTER TABLE inbox_rejections ADD COLUMN payload_size BIGINT;

ALTER TABLE inbox_rejections DROP CONSTRAINT IF EXISTS inbox_rejections_reason_check;
ALTER TABLE inbox_rejections ADD CONSTRAINT inbox_rejections_reason_check
    CHECK (reason IN ('conflict', 'malformed', 'unknown_message', 'invalid_key', 'too_large'));
