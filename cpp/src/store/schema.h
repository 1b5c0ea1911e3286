#pragma once
// The database schema as numbered migrations, one list per database engine with the same
// numbering. Migration i (1-based) takes a database at schema version i-1 to i; they are
// applied in order at open, each in a transaction. Append new migrations at the end of both
// lists; never edit one that has shipped.

#include <vector>

#include "store/sql.h"

namespace cartridges::schema {

const std::vector<const char*>& migrations(sql::Dialect dialect);

}  // namespace cartridges::schema
