-- Count an existing request as queued or running again, as a resume is about to make it.
-- KEYS: record, active, tenant_active
-- ARGV: score (unix ms), bound, tenant_bound (-1: none)
-- Returns OK, OVER_BOUND or OVER_TENANT_BOUND.
return admit(active, tenant_active, record, score, bound, tenant_bound)
